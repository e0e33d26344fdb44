"""What the bridge knows about one worker's KV-cache groups, learned from the events themselves.

Consumers need each group's kind, block size and sliding window to apply vLLM's hit rule, and
vLLM sends them only on stores (``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``,
``block_size``). A clear must reach every group the worker has, including groups only seen in
removals so far, so the catalog also remembers every group index it has met.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from hmakv.producer.events import BlockRemoved, BlockStored, GroupSpec, KVEvent, has_group_sizes

UNKNOWN_KIND = "unknown"  # vLLM's own name for a group whose kind it does not report
_StoreKey = tuple[int, str | None, int | None, int]  # (group, kind, window, block size)


class GroupCatalog:
    """Group specs by group index: configured ones win for what the wire does not carry.

    ``configured`` specs come from the bridge's engine configuration (``chunk_size`` never
    travels on the wire); the kind, window and block size a store reports replace what was
    known, since the engine is the authority on its own groups.
    """

    def __init__(
        self,
        learned: Mapping[int, GroupSpec] | None = None,
        configured: Mapping[int, GroupSpec] | None = None,
    ) -> None:
        self._configured = dict(configured or {})
        self._specs: dict[int, GroupSpec] = {**(learned or {}), **self._configured}
        self._seen: set[int] = set(self._specs)
        # (group, kind, window, block size) of stores already learned: the hot path's shortcut.
        self._learned_keys: set[_StoreKey] = set()
        self._groups = tuple(sorted(self._seen)) or (0,)

    @property
    def specs(self) -> dict[int, GroupSpec]:
        return dict(self._specs)

    @property
    def groups(self) -> tuple[int, ...]:
        """Every group a clear must reach, in index order; group 0 when none is known yet."""
        return self._groups

    def learn(self, events: Iterable[KVEvent]) -> bool:
        """Take in the groups of a batch's events; True when the catalog changed.

        Runs for every batch: an event whose group and spec are known already costs one tuple
        and one set lookup.
        """
        changed = False
        learned, seen = self._learned_keys, self._seen
        for event in events:
            if type(event) is BlockStored:
                group = event.group_idx or 0
                window = event.kv_cache_spec_sliding_window
                key = (group, event.kv_cache_spec_kind, window, event.block_size)
                if key not in learned:
                    changed |= self._learn_store(key, event)
            elif type(event) is BlockRemoved and (event.group_idx or 0) not in seen:
                changed |= self._see(event.group_idx or 0)
        return changed

    def _learn_store(self, key: _StoreKey, store: BlockStored) -> bool:
        self._learned_keys.add(key)
        group = key[0]
        seen = self._see(group)
        if not has_group_sizes(store):
            return seen  # no group has its sizes: it would make the workers' state unreadable
        spec = self._spec_from(group, store)
        if self._specs.get(group) == spec:
            return seen
        self._specs[group] = spec
        # The group's earlier stores no longer describe it: should one come again (an engine
        # restarted with its former configuration), it must be learned again, not skipped.
        self._learned_keys = {known for known in self._learned_keys if known[0] != group}
        self._learned_keys.add(key)
        return True

    def _spec_from(self, group: int, store: BlockStored) -> GroupSpec:
        configured = self._configured.get(group)
        kind = store.kv_cache_spec_kind or (configured.kind if configured else UNKNOWN_KIND)
        window = store.kv_cache_spec_sliding_window
        if window is None and configured is not None:
            window = configured.sliding_window
        chunk_size = configured.chunk_size if configured else None
        return GroupSpec(kind, store.block_size, window, chunk_size)

    def _see(self, group: int) -> bool:
        if group in self._seen:
            return False
        self._seen.add(group)
        self._groups = tuple(sorted(self._seen))
        return True
