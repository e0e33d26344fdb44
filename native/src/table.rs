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

/// A prompt's keys as a lookup reads them: packed u64s (the hasher's `array('Q')`, copied once),
/// a list's items without a Python index each, or any other sequence's.
enum Keys<'py> {
    Packed(Vec<u64>),
    List(Bound<'py, PyList>),
    Any(Bound<'py, PyAny>),
}

impl<'py> Keys<'py> {
    fn of(py: Python<'_>, keys: &Bound<'py, PyAny>) -> PyResult<Self> {
        if let Ok(list) = keys.downcast::<PyList>() {
            return Ok(Self::List(list.clone()));
        }
        match PyBuffer::<u64>::get(keys) {
            Ok(packed) if packed.dimensions() == 1 => Ok(Self::Packed(packed.to_vec(py)?)),
            _ => Ok(Self::Any(keys.clone())),
        }
    }

    fn len(&self) -> PyResult<usize> {
        match self {
            Self::Packed(packed) => Ok(packed.len()),
            Self::List(list) => Ok(list.len()),
            Self::Any(keys) => keys.len(),
        }
    }

    /// The key at `index` (< `len`), if it is one a table can hold.
    fn at(&self, index: usize) -> PyResult<Option<u64>> {
        Ok(match self {
            Self::Packed(packed) => Some(packed[index]),
            Self::List(list) => list.get_item(index)?.extract().ok(),
            Self::Any(keys) => keys.get_item(index)?.extract().ok(),
        })
    }
}

impl BlockTable {
    fn held(&self, py: Python<'_>, key: u64, zero: &PyObject) -> PyObject {
        self.map.get(&key).unwrap_or(zero).clone_ref(py)
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
        let keys = Keys::of(py, keys)?;
        let count = keys.len()?;
        let mut values = Vec::with_capacity(count);
        for index in 0..count {
            let key = keys.at(index)?;
            let value = key.and_then(|key| self.map.get(&key)).unwrap_or(&default);
            values.push(value.clone_ref(py));
        }
        Ok(values)
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
        let keys = Keys::of(py, keys)?;
        let available = keys.len()?;
        let (mut edges, mut held) = (Vec::new(), Vec::<PyObject>::new());
        let mut read = 0;
        while read < count && read * step + step - 1 < available {
            let key = keys.at(read * step + step - 1)?;
            let value = key.and_then(|key| self.map.get(&key)).unwrap_or(&zero);
            let same = match held.last() {
                Some(last) => last.as_ptr() == value.as_ptr() || last.bind(py).eq(value)?,
                None => false,
            };
            if !same {
                edges.push(read);
                held.push(value.clone_ref(py));
            }
            read += 1;
        }
        edges.push(read);
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
        for item in hashes.try_iter()? {
            let Some(key) = block_key(&item?) else {
                refused += 1;
                continue;
            };
            let held = self.held(py, key, &zero);
            if !Memo::hit(&memo, &held) {
                let answer = derive.call1((held.clone_ref(py),))?;
                let answer = (!answer.is_none()).then(|| answer.unbind());
                memo = Some(Memo { held, answer });
            }
            let stored = memo.as_ref().and_then(|m| m.answer.as_ref());
            match stored {
                None => copies.push(key),
                Some(_) if added >= room => refused += 1,
                Some(value) => {
                    self.map.insert(key, value.clone_ref(py));
                    added += 1;
                }
            }
        }
        Ok((added, refused, copies))
    }

    /// Remove one copy of each hash, as `PyBlockTable.remove` says: (dropped, missing, partial).
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
        for item in hashes.try_iter()? {
            let Some(key) = block_key(&item?) else {
                missing += 1;
                continue;
            };
            let held = self.held(py, key, &zero);
            if !Memo::hit(&memo, &held) {
                let (has, full_copy, rest): (bool, bool, Bound<'_, PyAny>) =
                    classify.call1((held.clone_ref(py),))?.extract()?;
                let rest = rest.is_truthy()?.then(|| rest.unbind());
                memo = Some(Memo {
                    held,
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
                    self.map.insert(key, rest.clone_ref(py));
                }
                None => {
                    self.map.remove(&key);
                }
            }
            dropped += 1;
        }
        Ok((dropped, missing, partial))
    }
}
