//! `BlockTable`: one medium's block hash -> packed holders table of the index, with the loops
//! that apply a store and a removal to it. `consumers/block_table.py` is the specification
//! (`PyBlockTable`, a dict with the same methods); tests/consumers/test_block_table.py checks
//! that both agree.
//!
//! A hash is held as a u64 beside a reference to its Python value (~17 bytes with the table's
//! control byte, against ~100 for a dict's int key, entry and slack), and a store or removal of
//! a run of blocks is one call: the per-block work (lookup, the run's memo, insert or delete) is
//! native, and Python decides only once per distinct holder value (`derive`, `classify`). A
//! hash that is no u64 is never held: a store refuses it, a removal finds it missing.
//!
//! A wide fleet's table is far larger than the CPU's caches (1,000 workers x 100k blocks is
//! ~2 GiB), so its lookups are mostly cache and TLB misses, and misses overlap only while the
//! lookups run back to back: between Python calls (a list's next int, a `derive`) they come one
//! at a time. So every loop reads its keys out of Python first, and a store or removal then
//! looks them all up in one tight pass that brings their slots into the caches before the loop
//! that changes them (BENCHMARKS.md, Fleet, "Lookups back to back").

use hashbrown::hash_map::Entry;
use hashbrown::HashMap;
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyKeyError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyInt, PyList};

#[pyclass(mapping, module = "hmakv_native")]
#[derive(Default)]
pub struct BlockTable {
    map: HashMap<u64, PyObject>,
}

/// The last holder value a loop derived from, kept alive so that its address stays its own.
struct Memo<T> {
    held: PyObject,
    answer: T,
}

impl<T> Memo<T> {
    fn hit(memo: &Option<Self>, held: &PyObject) -> bool {
        memo.as_ref()
            .is_some_and(|m| m.held.as_ptr() == held.as_ptr())
    }
}

/// A stored or removed block's key: an exact int in u64's range (not a bool, not a subclass).
fn block_key(item: &Bound<'_, PyAny>) -> Option<u64> {
    if !item.is_exact_instance_of::<PyInt>() {
        return None;
    }
    item.extract().ok()
}

/// Every `step`-th of a prompt's keys from the `step`-th on, up to `count` (as many as there
/// are), read out of Python before the table is (see the module's docs): an `array('Q')` (the
/// hasher's) in place, a list's items directly, any other sequence's item by item. None: a key
/// no table can hold.
fn prompt_keys(
    py: Python<'_>,
    keys: &Bound<'_, PyAny>,
    step: usize,
    count: usize,
) -> PyResult<Vec<Option<u64>>> {
    let picked = |len: usize| (0..count.min(len / step)).map(move |read| read * step + step - 1);
    if let Ok(list) = keys.downcast::<PyList>() {
        return picked(list.len())
            .map(|at| Ok(list.get_item(at)?.extract().ok()))
            .collect();
    }
    if let Ok(packed) = PyBuffer::<u64>::get(keys) {
        if packed.dimensions() == 1 {
            let packed = packed.to_vec(py)?;
            return Ok(picked(packed.len()).map(|at| Some(packed[at])).collect());
        }
    }
    picked(keys.len()?)
        .map(|at| Ok(keys.get_item(at)?.extract().ok()))
        .collect()
}

impl BlockTable {
    fn value<'a>(&'a self, key: Option<u64>, default: &'a PyObject) -> &'a PyObject {
        key.and_then(|key| self.map.get(&key)).unwrap_or(default)
    }

    /// A store's or a removal's keys (None: no u64), read out of Python and then looked up in
    /// one pass, whose answers are dropped: the loop after it finds their slots in the caches.
    fn block_keys(&self, hashes: &Bound<'_, PyAny>) -> PyResult<Vec<Option<u64>>> {
        let keys = hashes
            .try_iter()?
            .map(|item| Ok(block_key(&item?)))
            .collect::<PyResult<Vec<_>>>()?;
        for key in keys.iter().flatten() {
            std::hint::black_box(self.map.get(key));
        }
        Ok(keys)
    }
}

#[pymethods]
impl BlockTable {
    /// Empty, or holding `items`' (hash, value) pairs.
    #[new]
    #[pyo3(signature = (items=None))]
    fn new(items: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let mut table = Self::default();
        if let Some(items) = items {
            for item in items.try_iter()? {
                let (key, value): (u64, PyObject) = item?.extract()?;
                table.map.insert(key, value);
            }
        }
        Ok(table)
    }

    fn __len__(&self) -> usize {
        self.map.len()
    }

    fn __contains__(&self, key: &Bound<'_, PyAny>) -> bool {
        key.extract::<u64>()
            .is_ok_and(|key| self.map.contains_key(&key))
    }

    fn __getitem__(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<PyObject> {
        match key.extract::<u64>().ok().and_then(|k| self.map.get(&k)) {
            Some(value) => Ok(value.clone_ref(py)),
            None => Err(PyKeyError::new_err(key.clone().unbind())),
        }
    }

    fn __setitem__(&mut self, key: u64, value: PyObject) {
        self.map.insert(key, value);
    }

    fn __delitem__(&mut self, key: &Bound<'_, PyAny>) -> PyResult<()> {
        match key.extract::<u64>().ok().and_then(|k| self.map.remove(&k)) {
            Some(_) => Ok(()),
            None => Err(PyKeyError::new_err(key.clone().unbind())),
        }
    }

    #[pyo3(signature = (key, default=None))]
    fn get(&self, py: Python<'_>, key: &Bound<'_, PyAny>, default: Option<PyObject>) -> PyObject {
        match key.extract::<u64>().ok().and_then(|key| self.map.get(&key)) {
            Some(value) => value.clone_ref(py),
            None => default.unwrap_or_else(|| py.None()),
        }
    }

    /// Each key's value, or `default`: a prompt's column, in one call.
    fn get_many(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        default: PyObject,
    ) -> PyResult<Vec<PyObject>> {
        let keys = prompt_keys(py, keys, 1, usize::MAX)?;
        Ok(keys
            .iter()
            .map(|key| self.value(*key, &default).clone_ref(py))
            .collect())
    }

    /// `PyBlockTable.runs`: the holders of every `step`-th key as runs, found while looked up
    /// (a run's neighbours share one int, so most are told apart by address).
    fn runs(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        step: usize,
        count: usize,
    ) -> PyResult<(Vec<usize>, Vec<PyObject>)> {
        if step == 0 {
            return Err(PyValueError::new_err("step must be positive, got 0"));
        }
        let zero = 0u8.into_pyobject(py)?.into_any().unbind();
        let keys = prompt_keys(py, keys, step, count)?;
        let (mut edges, mut held) = (Vec::new(), Vec::<PyObject>::new());
        for (read, key) in keys.iter().enumerate() {
            let value = self.value(*key, &zero);
            let same = match held.last() {
                Some(last) => last.as_ptr() == value.as_ptr() || last.bind(py).eq(value)?,
                None => false,
            };
            if !same {
                edges.push(read);
                held.push(value.clone_ref(py));
            }
        }
        edges.push(keys.len());
        Ok((edges, held))
    }

    /// The keys, in the order `values` and `items` give theirs while the table is unchanged.
    fn keys(&self) -> Vec<u64> {
        self.map.keys().copied().collect()
    }

    fn values(&self, py: Python<'_>) -> Vec<PyObject> {
        self.map.values().map(|value| value.clone_ref(py)).collect()
    }

    fn items(&self, py: Python<'_>) -> Vec<(u64, PyObject)> {
        self.map
            .iter()
            .map(|(key, value)| (*key, value.clone_ref(py)))
            .collect()
    }

    /// Over a snapshot of the keys: the table may change while they are iterated.
    fn __iter__(&self, py: Python<'_>) -> PyResult<PyObject> {
        let keys = PyList::new(py, self.map.keys())?;
        Ok(keys.try_iter()?.into_any().unbind())
    }

    /// Every value replaced by `change(value)`, called once per distinct value in a row.
    fn map_values(&mut self, py: Python<'_>, change: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut memo: Option<Memo<PyObject>> = None;
        for value in self.map.values_mut() {
            if !Memo::hit(&memo, value) {
                let changed = change.call1((value.clone_ref(py),))?.unbind();
                memo = Some(Memo {
                    held: value.clone_ref(py),
                    answer: changed,
                });
            }
            if let Some(memo) = &memo {
                *value = memo.answer.clone_ref(py);
            }
        }
        Ok(())
    }

    /// Store each hash, as `PyBlockTable.store` says: (added, refused, the hashes held already).
    /// Each key is hashed once (the map's entry answers both the lookup and the write).
    fn store(
        &mut self,
        py: Python<'_>,
        hashes: &Bound<'_, PyAny>,
        room: usize,
        derive: &Bound<'_, PyAny>,
    ) -> PyResult<(usize, usize, Vec<u64>)> {
        let zero = 0u8.into_pyobject(py)?.into_any().unbind();
        let (mut added, mut refused, mut copies) = (0, 0, Vec::new());
        let mut memo: Option<Memo<Option<PyObject>>> = None;
        for key in self.block_keys(hashes)? {
            let Some(key) = key else {
                refused += 1;
                continue;
            };
            let entry = self.map.entry(key);
            let held = match &entry {
                Entry::Occupied(occupied) => occupied.get(),
                Entry::Vacant(_) => &zero,
            };
            if !Memo::hit(&memo, held) {
                let answer = derive.call1((held.clone_ref(py),))?;
                let answer = (!answer.is_none()).then(|| answer.unbind());
                memo = Some(Memo {
                    held: held.clone_ref(py),
                    answer,
                });
            }
            match memo.as_ref().and_then(|m| m.answer.as_ref()) {
                None => copies.push(key),
                Some(_) if added >= room => refused += 1,
                Some(value) => {
                    entry.insert(value.clone_ref(py));
                    added += 1;
                }
            }
        }
        Ok((added, refused, copies))
    }

    /// Remove one copy of each hash, as `PyBlockTable.remove` says: (dropped, missing, partial).
    /// Each key is hashed once, as in `store`.
    #[pyo3(signature = (hashes, classify, extra))]
    fn remove(
        &mut self,
        py: Python<'_>,
        hashes: &Bound<'_, PyAny>,
        classify: &Bound<'_, PyAny>,
        extra: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<(usize, usize, usize)> {
        let zero = 0u8.into_pyobject(py)?.into_any().unbind();
        let (mut dropped, mut missing, mut partial) = (0, 0, 0);
        let mut memo: Option<Memo<(bool, bool, Option<PyObject>)>> = None;
        for key in self.block_keys(hashes)? {
            let Some(key) = key else {
                missing += 1;
                continue;
            };
            let entry = self.map.entry(key);
            let held = match &entry {
                Entry::Occupied(occupied) => occupied.get(),
                Entry::Vacant(_) => &zero,
            };
            if !Memo::hit(&memo, held) {
                let (has, full_copy, rest): (bool, bool, Bound<'_, PyAny>) =
                    classify.call1((held.clone_ref(py),))?.extract()?;
                let rest = rest.is_truthy()?.then(|| rest.unbind());
                memo = Some(Memo {
                    held: held.clone_ref(py),
                    answer: (has, full_copy, rest),
                });
            }
            let Some(Memo {
                answer: (has, full_copy, rest),
                ..
            }) = memo.as_ref()
            else {
                unreachable!("the memo was just set");
            };
            let Entry::Occupied(mut occupied) = entry else {
                missing += 1; // held by nobody: classify(0) cannot say the worker holds it
                continue;
            };
            if !has {
                missing += 1;
                continue;
            }
            partial += usize::from(*full_copy);
            if let Some(extra) = extra.filter(|extra| !extra.is_empty()) {
                if let Some(count) = extra.get_item(key)? {
                    let left: i64 = count.extract::<i64>()? - 1;
                    if left > 0 {
                        extra.set_item(key, left)?;
                    } else {
                        extra.del_item(key)?;
                    }
                    continue;
                }
            }
            match rest {
                Some(rest) => {
                    occupied.insert(rest.clone_ref(py));
                }
                None => {
                    occupied.remove();
                }
            }
            dropped += 1;
        }
        Ok((dropped, missing, partial))
    }
}
