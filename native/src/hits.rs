//! `longest_hits`: vLLM's hybrid prefix-hit rule for a whole catalog class of workers at once,
//! the score path's other hot loop. `consumers/hit_rule.py` is the specification (`Column`,
//! `Acceptance`, `longest_hits`, `_settle`); this is the same scan step for step over worker
//! bitsets held as u64 words, and tests/consumers/test_hits_native.py checks that both answer
//! alike. Each group arrives as its lane of a column: the runs' start blocks and each run's
//! holders already shifted down to worker slots and masked to the class's workers.

use num_bigint::BigUint;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// A worker set, one bit per slot, in a fixed number of words for one call.
#[derive(Clone, PartialEq, Eq)]
struct Bits(Vec<u64>);

impl Bits {
    fn and(&self, other: &Self) -> Self {
        Self(self.0.iter().zip(&other.0).map(|(a, b)| a & b).collect())
    }

    fn and_assign(&mut self, other: &Self) {
        self.0.iter_mut().zip(&other.0).for_each(|(a, b)| *a &= b);
    }

    fn xor_assign(&mut self, other: &Self) {
        self.0.iter_mut().zip(&other.0).for_each(|(a, b)| *a ^= b);
    }

    fn any(&self) -> bool {
        self.0.iter().any(|&word| word != 0)
    }

    fn intersects(&self, other: &Self) -> bool {
        self.0.iter().zip(&other.0).any(|(a, b)| a & b != 0)
    }

    fn zero(words: usize) -> Self {
        Self(vec![0; words])
    }
}

/// A non-negative Python int as `words` u64 words (the caller masked it to `everyone`'s).
fn bits(value: &Bound<'_, PyAny>, words: usize) -> PyResult<Bits> {
    let mut out = vec![0u64; words];
    if words == 1 {
        out[0] = value.extract::<u64>()?;
    } else {
        let big: BigUint = value.extract()?;
        for (word, digit) in out.iter_mut().zip(big.iter_u64_digits()) {
            *word = digit;
        }
    }
    Ok(Bits(out))
}

fn to_int(py: Python<'_>, value: &Bits) -> PyResult<PyObject> {
    if value.0[1..].iter().all(|&word| word == 0) {
        // Most fleets' sets fit a word: made directly, not through a big int's bytes.
        return Ok(value.0[0].into_pyobject(py)?.into_any().unbind());
    }
    let digits: Vec<u32> = value
        .0
        .iter()
        .flat_map(|&word| [word as u32, (word >> 32) as u32])
        .collect();
    Ok(BigUint::new(digits).into_pyobject(py)?.into_any().unbind())
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Rule {
    Prefix,
    Window,
    State,
    Chunk,
}

impl Rule {
    fn named(name: &str) -> PyResult<Self> {
        match name {
            "prefix" => Ok(Self::Prefix),
            "window" => Ok(Self::Window),
            "state" => Ok(Self::State),
            "chunk" => Ok(Self::Chunk),
            _ => Err(PyValueError::new_err(format!("unknown hit rule {name:?}"))),
        }
    }
}

/// One group's lane of a column (`hit_rule.Column` and `Acceptance` in one).
struct Lane {
    rule: Rule,
    block_size: usize,
    window_blocks: usize,
    chunk_size: usize,
    edges: Vec<usize>,
    held: Vec<Bits>,
    prefix: Vec<Bits>,
    everyone: Bits,
}

/// What Python hands over per group: rule, block size, window blocks, chunk size, run edges,
/// run holders (the lane, masked).
type LaneArgs<'py> = (
    String,
    usize,
    usize,
    usize,
    Vec<usize>,
    Vec<Bound<'py, PyAny>>,
);

impl Lane {
    fn new(args: LaneArgs<'_>, everyone: &Bits) -> PyResult<Self> {
        let (rule, block_size, window_blocks, chunk_size, edges, held) = args;
        if block_size == 0 || edges.len() != held.len() + 1 {
            return Err(PyValueError::new_err(
                "a lane needs a positive block size and one edge more than runs",
            ));
        }
        let words = everyone.0.len();
        let held = held
            .iter()
            .map(|value| bits(value, words))
            .collect::<PyResult<Vec<_>>>()?;
        // `Column.prefix`: the AND of runs 0..i-1, up to the first empty one.
        let mut prefix = vec![everyone.clone()];
        for run in &held {
            let next = prefix[prefix.len() - 1].and(run);
            if !next.any() {
                break;
            }
            prefix.push(next);
        }
        Ok(Self {
            rule: Rule::named(&rule)?,
            block_size,
            window_blocks,
            chunk_size,
            edges,
            held,
            prefix,
            everyone: everyone.clone(),
        })
    }

    fn bisect_left(&self, blocks: usize) -> usize {
        self.edges.partition_point(|&edge| edge < blocks)
    }

    fn held_through(&self, blocks: usize) -> Bits {
        let runs = self.bisect_left(blocks);
        self.prefix
            .get(runs)
            .cloned()
            .unwrap_or_else(|| Bits::zero(self.everyone.0.len()))
    }

    fn held_between(&self, start: usize, stop: usize) -> Bits {
        let mut held = self.everyone.clone();
        if start < stop {
            let first = self
                .edges
                .partition_point(|&edge| edge <= start)
                .saturating_sub(1);
            let last = self.bisect_left(stop).min(self.held.len());
            for run in &self.held[first.min(last)..last] {
                held.and_assign(run);
            }
        }
        held
    }

    fn longest_held(&self, wanted: &Bits, blocks: usize) -> usize {
        let (mut low, mut high) = (0, self.bisect_left(blocks).min(self.prefix.len() - 1));
        while low < high {
            let middle = (low + high).div_ceil(2);
            if self.prefix[middle].intersects(wanted) {
                low = middle;
            } else {
                high = middle - 1;
            }
        }
        blocks.min(self.edges[low])
    }

    fn last_held(&self, wanted: &Bits, below: usize) -> usize {
        let Some(run) = self.bisect_left(below).checked_sub(1) else {
            return 0;
        };
        let run = run.min(self.held.len().saturating_sub(1));
        if self
            .held
            .get(run)
            .is_some_and(|held| held.intersects(wanted))
        {
            return below;
        }
        (0..run)
            .rev()
            .find(|&earlier| self.held[earlier].intersects(wanted))
            .map_or(0, |found| self.edges[found + 1])
    }

    /// `Acceptance.accepts`: the workers this group accepts a hit of `tokens` for.
    fn accepts(&self, tokens: usize) -> Bits {
        let blocks = tokens / self.block_size;
        let start = match self.rule {
            Rule::Prefix => return self.held_through(blocks),
            Rule::Window => blocks.saturating_sub(self.window_blocks),
            Rule::State => blocks.saturating_sub(1),
            Rule::Chunk => tokens / self.chunk_size * self.chunk_size / self.block_size,
        };
        self.held_between(start, blocks)
    }

    /// `Acceptance.bound`: the longest length, at most `tokens`, any of `workers` may get.
    fn bound(&self, workers: &Bits, tokens: usize) -> usize {
        let blocks = tokens / self.block_size;
        match self.rule {
            Rule::Prefix => self.longest_held(workers, blocks) * self.block_size,
            Rule::Chunk => tokens,
            Rule::Window | Rule::State => self.last_held(workers, blocks) * self.block_size,
        }
    }
}

/// `hit_rule._settle`.
fn settle(lanes: &[Lane], workers: &Bits, mut tokens: usize, align: usize) -> usize {
    while tokens > 0 {
        let mut bound = tokens;
        let mut settled = true;
        for (position, lane) in lanes.iter().enumerate() {
            let lower = lane.bound(workers, bound);
            if lower != bound {
                settled = settled && position == 0;
                bound = lower;
            }
        }
        let aligned = bound / align * align;
        if aligned == tokens || (settled && aligned == bound) {
            return aligned;
        }
        tokens = aligned;
    }
    0
}

fn scan(lanes: &[Lane], everyone: &Bits, align: usize, max_tokens: usize) -> Vec<(usize, Bits)> {
    let mut remaining = everyone.clone();
    let mut hits = Vec::new();
    let mut tokens = settle(lanes, &remaining, max_tokens / align * align, align);
    while remaining.any() && tokens > 0 {
        let mut accepted = remaining.clone();
        for lane in lanes {
            accepted.and_assign(&lane.accepts(tokens));
            if !accepted.any() {
                break;
            }
        }
        if accepted.any() {
            remaining.xor_assign(&accepted);
            hits.push((tokens, accepted));
        }
        if remaining.any() {
            tokens = settle(lanes, &remaining, tokens.saturating_sub(align), align);
        }
    }
    if remaining.any() {
        hits.push((0, remaining));
    }
    hits
}

/// Each worker's longest hit that every group accepts, as (tokens, workers) pairs, longest
/// first: `hit_rule.longest_hits` over lanes.
#[pyfunction]
pub fn longest_hits(
    py: Python<'_>,
    lanes: Vec<LaneArgs<'_>>,
    everyone: &Bound<'_, PyAny>,
    align: usize,
    max_tokens: usize,
) -> PyResult<Vec<(usize, PyObject)>> {
    if align == 0 {
        return Err(PyValueError::new_err("align must be positive, got 0"));
    }
    let words = match everyone.extract::<u64>() {
        Ok(_) => 1,
        Err(_) => everyone
            .call_method0("bit_length")?
            .extract::<usize>()?
            .div_ceil(64),
    };
    let everyone = bits(everyone, words)?;
    let lanes = lanes
        .into_iter()
        .map(|lane| Lane::new(lane, &everyone))
        .collect::<PyResult<Vec<_>>>()?;
    if !everyone.any() {
        return Ok(Vec::new());
    }
    let hits = py.allow_threads(|| scan(&lanes, &everyone, align, max_tokens));
    hits.iter()
        .map(|(tokens, workers)| Ok((*tokens, to_int(py, workers)?)))
        .collect()
}
