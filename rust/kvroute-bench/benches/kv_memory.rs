//! Memory of the events view at 10 million (block, engine) memberships, measured as the
//! process's resident set before and after (`/proc/self/statm`) and as the view's own table
//! bytes, in two layouts: every block on one of 8 engines, and every block on 2 of 8 engines
//! (half as many distinct blocks); with the tables sized for the engines' KV capacity first
//! (as the proxy does from `vllm:cache_config_info`) and without (grown as blocks come). Also
//! the time to apply them. Linux only.
//! Run: `cargo bench -p kvroute-bench --bench kv_memory` (prints a table).

use std::time::{Duration, Instant};

use kvroute_bench::mix;
use kvroute_core::events::{EventBatch, EventView, KvEvent, StoredBlocks};

const BS: usize = 16;
const PER_EVENT: usize = 1000;
const ENGINES: usize = 8;

fn rss_bytes() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: usize = statm.split_whitespace().nth(1).and_then(|p| p.parse().ok()).unwrap_or(0);
    pages * 4096
}

/// `memberships` memberships, each distinct block held by `holders` engines.
fn measure(memberships: usize, holders: usize, reserved: bool) {
    let before = rss_bytes();
    let mut view = EventView::new(ENGINES, BS as u64, Duration::ZERO);
    if reserved {
        for e in 0..ENGINES {
            view.reserve(e, memberships / ENGINES);
        }
    }
    let mut tokens = vec![0u32; PER_EVENT * BS];
    for (t, tok) in tokens.iter_mut().enumerate() {
        *tok = (t % 30_000) as u32;
    }
    let mut seqs = [0u64; ENGINES];
    let sequences = memberships / holders / PER_EVENT;
    let started = Instant::now();
    for s in 0..sequences {
        tokens[0] = s as u32; // a distinct first block: every key of the sequence is new
        for h in 0..holders {
            let engine = (s + h * 3) % ENGINES;
            let hashes =
                (0..PER_EVENT).map(|b| mix(((s * PER_EVENT + b) * ENGINES + engine) as u64)).collect();
            let event = KvEvent::Stored(StoredBlocks {
                hashes,
                parent: None,
                token_ids: tokens.clone(),
                block_size: BS as u32,
                ignored: None,
            });
            view.apply(
                engine,
                seqs[engine],
                &EventBatch { ts: 0.0, events: vec![event], rank: 0 },
                false,
                None,
            )
            .expect("rank");
            seqs[engine] += 1;
        }
    }
    let took = started.elapsed().as_secs_f64();
    let n = sequences * PER_EVENT * holders;
    let rss = rss_bytes().saturating_sub(before);
    println!(
        "| {n} | {holders} | {} | {} | {:.1} | {:.1} | {:.2} M/s |",
        view.distinct_keys(),
        if reserved { "engine capacity" } else { "grown" },
        rss as f64 / n as f64,
        view.memory_bytes() as f64 / n as f64,
        n as f64 / took / 1e6
    );
    drop(view);
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // `cargo bench -- --list` (criterion's protocol): no benchmarks to list
    }
    println!("| memberships | engines per block | distinct blocks | tables sized by | RSS bytes/membership | table bytes/membership | applied |");
    println!("|---|---|---|---|---|---|---|");
    for reserved in [true, false] {
        measure(10_000_000, 1, reserved);
        measure(10_000_000, 2, reserved);
    }
}
