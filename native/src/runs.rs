//! `RecordRuns`: a record's events as the runs the index hands its block tables, read without
//! the interpreter (a vLLM step is many events of a few blocks each, and reading them in Python
//! cost more than applying their blocks). `consumers/record_runs.py` is the specification
//! (`py_record_runs`); tests/consumers/test_record_runs.py checks that both agree.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt, PyList, PyString, PyTuple, PyType};

const EXTERNAL_HASH_BYTES: usize = 8;

#[pyclass(frozen, module = "hmakv_native")]
pub struct RecordRuns {
    stored: Py<PyType>,
    removed: Py<PyType>,
    gpu: Py<PyString>,
}

/// A run as Python gets it: stores (else removals), medium, hashes.
type PyRun<'py> = (bool, Bound<'py, PyAny>, Bound<'py, PyList>);

/// The run being gathered: its events' hash lists, made one list once the run is complete.
struct Run<'py> {
    stores: bool,
    medium: Bound<'py, PyAny>,
    parts: Vec<Bound<'py, PyAny>>,
}

impl<'py> Run<'py> {
    /// The run as Python gets it; None for a hash that is neither int nor digest. A run of one
    /// event whose list is already in the key form is that list (vLLM's CPU tiers and older
    /// engines send one event of many blocks: a copy of it cost as much as reading it).
    fn into_py(self, py: Python<'py>) -> PyResult<Option<PyRun<'py>>> {
        if let [only] = self.parts.as_slice() {
            if let Ok(list) = only.downcast_exact::<PyList>() {
                let keyed = list.is_empty() || list.get_item(0)?.is_exact_instance_of::<PyInt>();
                if keyed {
                    return Ok(Some((self.stores, self.medium, list.clone())));
                }
            }
        }
        let hashes = PyList::empty(py);
        for part in &self.parts {
            if !append_keys(part, &hashes)? {
                return Ok(None);
            }
        }
        Ok(Some((self.stores, self.medium, hashes)))
    }
}

/// `a == b` as a tuple's comparison makes it: the same object, or equal.
fn same(a: &Bound<'_, PyAny>, b: &Bound<'_, PyAny>) -> PyResult<bool> {
    Ok(a.is(b) || a.eq(b)?)
}

/// The int vLLM puts on the wire for a digest: its last 8 bytes, unsigned big-endian.
fn external(digest: &[u8]) -> u64 {
    let tail = &digest[digest.len().saturating_sub(EXTERNAL_HASH_BYTES)..];
    tail.iter()
        .fold(0, |value, byte| value << 8 | u64::from(*byte))
}

/// The hashes appended in the index's key form; false for one that is neither int nor digest.
fn append_keys(hashes: &Bound<'_, PyAny>, into: &Bound<'_, PyList>) -> PyResult<bool> {
    let items = match hashes.downcast::<PyList>() {
        Ok(list) => list.iter().collect::<Vec<_>>(),
        Err(_) => hashes.try_iter()?.collect::<PyResult<Vec<_>>>()?,
    };
    let ints = items
        .first()
        .is_none_or(|first| first.is_exact_instance_of::<PyInt>());
    for item in items {
        if ints || item.is_instance_of::<PyInt>() {
            into.append(item)?;
        } else if let Ok(digest) = item.downcast::<PyBytes>() {
            into.append(external(digest.as_bytes()))?;
        } else {
            return Ok(false);
        }
    }
    Ok(true)
}

impl RecordRuns {
    /// `py_record_runs`' `_teaches`: whether the index learns or counts anything of the store.
    fn teaches(
        &self,
        store: &Bound<'_, PyAny>,
        medium: &Bound<'_, PyAny>,
        hashes: &Bound<'_, PyAny>,
        known: Option<&[Bound<'_, PyAny>; 3]>,
        lookahead: usize,
    ) -> PyResult<bool> {
        let py = store.py();
        let Some([known_kind, known_size, known_window]) = known else {
            return Ok(true);
        };
        let kind = store.getattr(intern!(py, "kv_cache_spec_kind"))?;
        let size = store.getattr(intern!(py, "block_size"))?;
        let window = store.getattr(intern!(py, "kv_cache_spec_sliding_window"))?;
        let matches =
            same(&kind, known_kind)? && same(&size, known_size)? && same(&window, known_window)?;
        if !matches {
            let sized = size.gt(0)? && (window.is_none() || window.gt(0)?);
            if !kind.is_none() || !sized {
                return Ok(true);
            }
        }
        if hashes.is_truthy()? && same(medium, self.gpu.bind(py).as_any())? {
            let ids = store.getattr(intern!(py, "lookahead_token_ids"))?;
            let tokens = if ids.is_truthy()? {
                ids.get_item(0)?.len()?
            } else {
                0
            };
            return Ok(tokens != lookahead);
        }
        Ok(false)
    }
}

#[pymethods]
impl RecordRuns {
    #[new]
    fn new(stored: Py<PyType>, removed: Py<PyType>, gpu: Py<PyString>) -> Self {
        Self {
            stored,
            removed,
            gpu,
        }
    }

    /// `py_record_runs(events, known, lookahead)`.
    #[pyo3(signature = (events, known, lookahead, /))]
    fn __call__<'py>(
        &self,
        events: &Bound<'py, PyAny>,
        known: Option<&Bound<'py, PyTuple>>,
        lookahead: usize,
    ) -> PyResult<Option<Vec<PyRun<'py>>>> {
        let py = events.py();
        let (stored, removed) = (self.stored.bind(py), self.removed.bind(py));
        // A known spec that is no 3-tuple matches no store, as a tuple's comparison says.
        let known = match known {
            Some(known) if known.len() == 3 => {
                Some([known.get_item(0)?, known.get_item(1)?, known.get_item(2)?])
            }
            _ => None,
        };
        let mut runs: Vec<Run<'py>> = Vec::new();
        for event in events.try_iter()? {
            let event = event?;
            let stores = if event.is_instance(stored)? {
                true
            } else if event.is_instance(removed)? {
                false
            } else {
                return Ok(None); // a clear
            };
            let named = event.getattr(intern!(py, "medium"))?;
            let medium = if named.is_truthy()? {
                named
            } else {
                self.gpu.bind(py).clone().into_any()
            };
            let hashes = event.getattr(intern!(py, "block_hashes"))?;
            if stores && self.teaches(&event, &medium, &hashes, known.as_ref(), lookahead)? {
                return Ok(None);
            }
            let continues = match runs.last() {
                Some(run) => run.stores == stores && same(&run.medium, &medium)?,
                None => false,
            };
            match runs.last_mut() {
                Some(run) if continues => run.parts.push(hashes),
                _ => runs.push(Run {
                    stores,
                    medium,
                    parts: vec![hashes],
                }),
            }
        }
        runs.into_iter().map(|run| run.into_py(py)).collect()
    }
}
