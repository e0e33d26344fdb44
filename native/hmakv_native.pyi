# token_ids: ints, or bytes of little-endian uint32s (packed).
def block_hashes(
    hash_fn: str,
    parent: bytes,
    token_ids: list[int] | tuple[int, ...] | bytes,
    block_size: int,
    lookahead: int = 0,
) -> list[bytes]: ...
def external_hashes(
    hash_fn: str,
    parent: bytes,
    token_ids: list[int] | tuple[int, ...] | bytes,
    block_size: int,
    lookahead: int = 0,
) -> list[int]: ...
