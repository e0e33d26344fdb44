//! Dynamo's native RadixTree (dynamo-kv-router 1.6.1, the tree its Python binding wraps) on the
//! events and prompts `benchmarks/index.py --native` writes: the seconds each apply of the
//! stream takes and each `find_matches` call, and the overlaps it answers, as JSON on stdout.
//! Events are parsed before the clock starts: what is timed is the tree alone.
//!
//!     dynamo-native-bench INPUT.json

use std::collections::BTreeMap;
use std::hint::black_box;
use std::time::Instant;

use dynamo_kv_router::protocols::KvCacheEvent;
use dynamo_kv_router::{LocalBlockHash, RadixTree, RouterEvent, WorkerId};
use serde::{Deserialize, Serialize};

type Events = Vec<(WorkerId, KvCacheEvent)>;

#[derive(Deserialize)]
struct Input {
    repeats: usize,
    calls: usize,
    /// The stream of (a), applied `repeats` times to a fresh tree each.
    apply: Events,
    /// The state of (b), which the prompts are scored against.
    score_state: Events,
    prompts: BTreeMap<String, Vec<u64>>,
}

#[derive(Serialize)]
struct Output {
    apply_seconds: Vec<f64>,
    refused: usize,
    score_seconds: BTreeMap<String, Vec<f64>>,
    overlaps: BTreeMap<String, BTreeMap<WorkerId, u32>>,
}

fn router_events(events: &Events) -> Vec<RouterEvent> {
    events
        .iter()
        .map(|(worker, event)| RouterEvent::new(*worker, event.clone()))
        .collect()
}

/// Applies every event; returns how many the tree refused.
fn apply(tree: &mut RadixTree, events: Vec<RouterEvent>) -> usize {
    let mut refused = 0;
    for event in events {
        if tree.apply_event(event).is_err() {
            refused += 1;
        }
    }
    refused
}

fn local_hashes(prompt: &[u64]) -> Vec<LocalBlockHash> {
    prompt.iter().map(|&hash| LocalBlockHash(hash)).collect()
}

fn time_apply(input: &Input) -> (Vec<f64>, usize) {
    let mut seconds = Vec::with_capacity(input.repeats);
    let mut refused = 0;
    for _ in 0..input.repeats {
        let events = router_events(&input.apply);
        let mut tree = RadixTree::new();
        let start = Instant::now();
        refused = apply(&mut tree, events);
        seconds.push(start.elapsed().as_secs_f64());
    }
    (seconds, refused)
}

/// Each prompt in turn, back to back, as the script times the index and the binding.
fn time_scores(tree: &RadixTree, input: &Input) -> BTreeMap<String, Vec<f64>> {
    let mut seconds: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for call in 0..input.calls {
        let name = if call % 2 == 1 { "whole" } else { "fork" };
        let query = local_hashes(&input.prompts[name]);
        let start = Instant::now();
        black_box(tree.find_matches(query, false));
        let elapsed = start.elapsed().as_secs_f64();
        seconds.entry(name.to_string()).or_default().push(elapsed);
    }
    seconds
}

fn overlaps(tree: &RadixTree, prompt: &[u64]) -> BTreeMap<WorkerId, u32> {
    let scores = tree.find_matches(local_hashes(prompt), false).scores;
    scores
        .into_iter()
        .map(|(worker, blocks)| (worker.worker_id, blocks))
        .collect()
}

fn main() {
    let path = std::env::args()
        .nth(1)
        .expect("usage: dynamo-native-bench INPUT.json");
    let text = std::fs::read(&path).expect("cannot read the input");
    let input: Input = serde_json::from_slice(&text).expect("not the input index.py writes");
    let (apply_seconds, refused) = time_apply(&input);
    let mut tree = RadixTree::new();
    let refused = refused + apply(&mut tree, router_events(&input.score_state));
    let output = Output {
        apply_seconds,
        refused,
        score_seconds: time_scores(&tree, &input),
        overlaps: input
            .prompts
            .iter()
            .map(|(name, prompt)| (name.clone(), overlaps(&tree, prompt)))
            .collect(),
    };
    println!("{}", serde_json::to_string(&output).expect("serializable"));
}
