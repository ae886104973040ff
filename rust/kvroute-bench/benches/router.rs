//! `Router::route` on a warm cluster and `ClusterCache::walk`, over
//! instances × keys-per-request (the grid of `benches/` on the Python side).
//!
//! `route` is timed alone: the request is built before the clock starts and finished after
//! it stops (see `kvroute_bench` for the workload). Run: `cargo bench -p kvroute-bench`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvroute_bench::{policy, WarmCache, WarmRouter};
use kvroute_core::cache::PrefixWalk;

const INSTANCES: [usize; 4] = [8, 64, 256, 1024];
const KEYS: [usize; 3] = [16, 128, 256];

/// Time `iters` warm `route` calls, excluding request building and `finish`.
fn timed_routes(w: &mut WarmRouter, iters: u64) -> Duration {
    (0..iters).map(|_| w.route_next_timed()).sum()
}

fn route_grid(c: &mut Criterion) {
    let mut g = c.benchmark_group("route/unified");
    for &keys in &KEYS {
        for &instances in &INSTANCES {
            let mut w = WarmRouter::new(instances, keys, policy("unified"));
            g.bench_function(BenchmarkId::new(format!("{keys}keys"), instances), |b| {
                b.iter_custom(|iters| timed_routes(&mut w, iters));
            });
            assert_eq!(w.cold_sessions(), 0, "a session prefix was evicted: cache bound too tight");
        }
    }
    g.finish();
    let mut g = c.benchmark_group("route/policy_8x128");
    for name in ["unified", "lmetric", "leastwork"] {
        let mut w = WarmRouter::new(8, 128, policy(name));
        g.bench_function(name, |b| b.iter_custom(|iters| timed_routes(&mut w, iters)));
        assert_eq!(w.cold_sessions(), 0, "a session prefix was evicted: cache bound too tight");
    }
    g.finish();
}

fn walk_grid(c: &mut Criterion) {
    let mut g = c.benchmark_group("walk");
    for &keys in &KEYS {
        for &instances in &INSTANCES {
            let w = WarmCache::new(instances, keys);
            let mut walk = PrefixWalk::default();
            let mut next = 0;
            g.bench_function(BenchmarkId::new(format!("{keys}keys"), instances), |b| {
                b.iter(|| {
                    let lookup = &w.lookups[next];
                    next = (next + 1) % w.lookups.len();
                    w.cache.walk(black_box(lookup), &mut walk);
                    black_box(walk.matched());
                });
            });
        }
    }
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sample_size(50)
}

criterion_group! {
    name = benches;
    config = config();
    targets = route_grid, walk_grid
}
criterion_main!(benches);
