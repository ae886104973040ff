//! The events view: applying `BlockStored`/`BlockRemoved` batches in the core (blocks per
//! second, at two resident sizes), decoding a msgpack batch, and `Router::route` with the
//! events view against the estimate view on the same warm workload (8, 64 and 512 instances,
//! 128-key requests). Run: `cargo bench -p kvroute-bench --bench events`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvroute_bench::{mix, policy, WarmRouter};
use kvroute_core::events::decode::decode_batch;
use kvroute_core::events::{EventBatch, EventView, KvEvent, StoredBlocks};
use kvroute_core::CacheView;

const BS: usize = 32;
/// Blocks per stored (and per removed) event: one request's new blocks.
const PER_BATCH: usize = 16;

/// A cycle of batches on one engine: batch `i` stores `PER_BATCH` new blocks (one sequence)
/// and removes those batch `i - resident / PER_BATCH` stored, so `resident` blocks stay.
fn cycle(resident: usize) -> Vec<EventBatch> {
    let lag = resident / PER_BATCH;
    let n = 2 * lag + 64;
    let hashes = |i: usize| (0..PER_BATCH).map(move |b| mix((i * PER_BATCH + b) as u64)).collect::<Vec<_>>();
    (0..n)
        .map(|i| {
            let tokens: Vec<u32> =
                (0..PER_BATCH * BS).map(|t| (mix((i * 7919 + t) as u64) % 32000) as u32).collect();
            let mut events = vec![KvEvent::Stored(StoredBlocks {
                hashes: hashes(i),
                parent: None,
                token_ids: tokens,
                block_size: BS as u32,
                ignored: None,
            })];
            // In the first pass these removals are of blocks not stored yet: unknown, skipped.
            events.push(KvEvent::Removed { hashes: hashes((i + n - lag) % n), ignored: None });
            EventBatch { ts: 0.0, events, rank: 0 }
        })
        .collect()
}

fn apply(c: &mut Criterion) {
    let mut g = c.benchmark_group("events/apply");
    for resident in [65_536, 1 << 20] {
        let batches = cycle(resident);
        let mut view = EventView::new(8, BS as u64, Duration::ZERO);
        let mut seq = 0u64;
        // Fill to the resident size first (removals of blocks not stored yet are unknown).
        for b in batches.iter().take(batches.len() - 64) {
            view.apply(0, seq, b, false, None).expect("rank");
            seq += 1;
        }
        g.throughput(Throughput::Elements(2 * PER_BATCH as u64)); // stored + removed blocks
        g.bench_function(BenchmarkId::new("blocks", resident), |b| {
            let mut i = 0;
            b.iter(|| {
                view.apply(0, seq, black_box(&batches[i]), false, None).expect("rank");
                seq += 1;
                i = (i + 1) % batches.len();
            });
        });
    }
    g.finish();
}

/// A map-encoded batch of one `BlockStored` of `PER_BATCH` blocks, as vLLM 0.32 sends it.
fn payload() -> Vec<u8> {
    let mut b = vec![0x93, 0xcb];
    b.extend(1.0f64.to_be_bytes());
    b.extend([0x91, 0x86, 0xa4]);
    b.extend(b"type");
    b.push(0xab);
    b.extend(b"BlockStored");
    b.push(0xac);
    b.extend(b"block_hashes");
    b.push(0xdc); // array16 (a fixarray holds at most 15)
    b.extend((PER_BATCH as u16).to_be_bytes());
    for i in 0..PER_BATCH {
        b.push(0xcf);
        b.extend(mix(i as u64).to_be_bytes());
    }
    b.push(0xb1);
    b.extend(b"parent_block_hash");
    b.push(0xc0);
    b.push(0xa9);
    b.extend(b"token_ids");
    b.push(0xdc);
    b.extend(((PER_BATCH * BS) as u16).to_be_bytes());
    for t in 0..PER_BATCH * BS {
        b.push(0xcd);
        b.extend(((t * 31 % 32000) as u16).to_be_bytes());
    }
    b.push(0xaa);
    b.extend(b"block_size");
    b.push(BS as u8);
    b.push(0xa6);
    b.extend(b"medium");
    b.push(0xa3);
    b.extend(b"GPU");
    b.push(0x00); // rank 0
    b
}

fn decode(c: &mut Criterion) {
    let p = payload();
    assert_eq!(decode_batch(&p).expect("decodes").events.len(), 1);
    let mut g = c.benchmark_group("events/decode");
    g.throughput(Throughput::Elements(PER_BATCH as u64));
    g.bench_function("blocks", |b| b.iter(|| decode_batch(black_box(&p))));
    g.finish();
}

fn route(c: &mut Criterion) {
    let mut g = c.benchmark_group("events/route_128keys");
    for instances in [8, 64, 512] {
        for view in [CacheView::Estimate, CacheView::Events] {
            let mut w = WarmRouter::with_view(instances, 128, policy("unified"), view);
            g.bench_function(BenchmarkId::new(view.name(), instances), |b| {
                b.iter_custom(|iters| (0..iters).map(|_| w.route_next_timed()).sum::<Duration>());
            });
            assert_eq!(w.cold_sessions(), 0, "a session prefix was lost");
        }
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sample_size(30);
    targets = apply, decode, route
}
criterion_main!(benches);
