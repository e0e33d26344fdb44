//! vLLM's chained prefix-cache block hashes (`sha256_cbor`, `xxhash_cbor`) for blocks without
//! extra keys: the score path's hot loop. `producer/hashing.py` is the specification; a block is
//! the canonical CBOR of `(parent digest, block tokens, keys)`, keys being `None`, or with
//! lookahead `(None, *the lookahead tokens)`. Tokens come as a list or tuple of ints, or packed:
//! one `bytes` of little-endian uint32s, read without a Python int per token.

mod hits;
mod runs;
mod table;

use minicbor::Encoder;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt, PyList, PyTuple};

const PACKED_TOKEN_BYTES: usize = 4;
use sha2::{Digest, Sha256};

#[derive(Clone, Copy)]
enum HashFn {
    Sha256Cbor,
    XxhashCbor,
}

impl HashFn {
    fn named(name: &str) -> PyResult<Self> {
        match name {
            "sha256_cbor" => Ok(Self::Sha256Cbor),
            "xxhash_cbor" => Ok(Self::XxhashCbor),
            _ => Err(PyValueError::new_err(format!(
                "unknown hash function {name:?}; native hashing knows sha256_cbor and xxhash_cbor"
            ))),
        }
    }

    fn size(self) -> usize {
        match self {
            Self::Sha256Cbor => 32,
            Self::XxhashCbor => 16,
        }
    }

    /// The digest of `data`, appended to `out`.
    fn digest_into(self, data: &[u8], out: &mut Vec<u8>) {
        match self {
            Self::Sha256Cbor => out.extend_from_slice(&Sha256::digest(data)),
            Self::XxhashCbor => {
                out.extend_from_slice(&xxhash_rust::xxh3::xxh3_128(data).to_be_bytes())
            }
        }
    }
}

/// The CBOR of one block, written into `buffer` (cleared first).
fn encode_block(buffer: &mut Vec<u8>, previous: &[u8], block: &[u64], lookahead: &[u64]) {
    buffer.clear();
    let mut encoder = Encoder::new(&mut *buffer);
    // Writing into a Vec cannot fail.
    encoder
        .array(3)
        .and_then(|e| e.bytes(previous))
        .expect("vec write");
    encoder.array(block.len() as u64).expect("vec write");
    for &token in block {
        encoder.u64(token).expect("vec write");
    }
    if lookahead.is_empty() {
        encoder.null().expect("vec write");
    } else {
        encoder
            .array(1 + lookahead.len() as u64)
            .and_then(|e| e.null())
            .expect("vec write");
        for &token in lookahead {
            encoder.u64(token).expect("vec write");
        }
    }
}

/// The chained digests of the full blocks, one after another, `hash_fn.size()` bytes each.
fn chain(
    hash_fn: HashFn,
    parent: &[u8],
    tokens: &[u64],
    block_size: usize,
    lookahead: usize,
) -> PyResult<Vec<u8>> {
    if block_size == 0 {
        return Err(PyValueError::new_err("block_size must be positive, got 0"));
    }
    let size = hash_fn.size();
    let num_blocks = tokens.len().saturating_sub(lookahead) / block_size;
    let mut buffer = Vec::with_capacity(64 + 9 * (block_size + lookahead));
    let mut digests: Vec<u8> = Vec::with_capacity(num_blocks * size);
    for index in 0..num_blocks {
        let start = index * block_size;
        let end = start + block_size;
        let previous = if index == 0 {
            parent
        } else {
            &digests[(index - 1) * size..index * size]
        };
        encode_block(
            &mut buffer,
            previous,
            &tokens[start..end],
            &tokens[end..end + lookahead],
        );
        hash_fn.digest_into(&buffer, &mut digests);
    }
    Ok(digests)
}

/// The tokens as u64s. Only exact ints are taken: cbor2 encodes a bool as `true`, not `1`, and a
/// token outside u64 as a bignum, so anything else raises (TypeError, OverflowError) and the caller
/// hashes those prompts in Python. Packed tokens are uint32s, always in range.
fn tokens(token_ids: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    if let Ok(list) = token_ids.downcast::<PyList>() {
        return list.iter().map(|item| token(&item)).collect();
    }
    if let Ok(tuple) = token_ids.downcast::<PyTuple>() {
        return tuple.iter().map(|item| token(&item)).collect();
    }
    if let Ok(packed) = token_ids.downcast::<PyBytes>() {
        return unpack(packed.as_bytes());
    }
    Err(PyTypeError::new_err(
        "token_ids must be a list or a tuple of ints, or bytes of little-endian uint32s",
    ))
}

fn unpack(packed: &[u8]) -> PyResult<Vec<u64>> {
    if !packed.len().is_multiple_of(PACKED_TOKEN_BYTES) {
        return Err(PyValueError::new_err(format!(
            "packed token ids are {PACKED_TOKEN_BYTES} bytes each: {} bytes is not a whole number",
            packed.len()
        )));
    }
    let chunks = packed.chunks_exact(PACKED_TOKEN_BYTES);
    Ok(chunks
        .map(|c| u64::from(u32::from_le_bytes([c[0], c[1], c[2], c[3]])))
        .collect())
}

fn token(item: &Bound<'_, PyAny>) -> PyResult<u64> {
    if !item.is_exact_instance_of::<PyInt>() {
        return Err(PyTypeError::new_err("token ids must be ints"));
    }
    item.extract()
}

fn external(digest: &[u8]) -> u64 {
    let mut tail = [0u8; 8];
    tail.copy_from_slice(&digest[digest.len() - 8..]);
    u64::from_be_bytes(tail)
}

/// The digests of the full blocks of `token_ids`, chained from `parent`.
#[pyfunction]
#[pyo3(signature = (hash_fn, parent, token_ids, block_size, lookahead=0))]
fn block_hashes<'py>(
    py: Python<'py>,
    hash_fn: &str,
    parent: &[u8],
    token_ids: &Bound<'_, PyAny>,
    block_size: usize,
    lookahead: usize,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let hash_fn = HashFn::named(hash_fn)?;
    let token_ids = tokens(token_ids)?;
    let size = hash_fn.size();
    let digests = py.allow_threads(|| chain(hash_fn, parent, &token_ids, block_size, lookahead))?;
    Ok(digests
        .chunks_exact(size)
        .map(|digest| PyBytes::new(py, digest))
        .collect())
}

/// The same blocks' hashes in vLLM's external form (each digest's last 8 bytes, big-endian), packed
/// as native-endian u64s: the bytes of an `array('Q')`, which the index's tables read in place.
#[pyfunction]
#[pyo3(signature = (hash_fn, parent, token_ids, block_size, lookahead=0))]
fn external_hashes<'py>(
    py: Python<'py>,
    hash_fn: &str,
    parent: &[u8],
    token_ids: &Bound<'_, PyAny>,
    block_size: usize,
    lookahead: usize,
) -> PyResult<Bound<'py, PyBytes>> {
    let hash_fn = HashFn::named(hash_fn)?;
    let token_ids = tokens(token_ids)?;
    let packed = py.allow_threads(|| {
        let digests = chain(hash_fn, parent, &token_ids, block_size, lookahead)?;
        let externals = digests.chunks_exact(hash_fn.size()).map(external);
        PyResult::Ok(externals.flat_map(u64::to_ne_bytes).collect::<Vec<u8>>())
    })?;
    Ok(PyBytes::new(py, &packed))
}

#[pymodule]
fn hmakv_native(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_function(wrap_pyfunction!(block_hashes, module)?)?;
    module.add_function(wrap_pyfunction!(external_hashes, module)?)?;
    module.add_function(wrap_pyfunction!(hits::longest_hits, module)?)?;
    module.add_class::<table::BlockTable>()?;
    module.add_class::<runs::RecordRuns>()?;
    Ok(())
}
