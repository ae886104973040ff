//! Block keys: `block_hashes_u32` (the zero-copy path of uint32 arrays), the checked generic
//! `block_hashes::<i32>` (what `kvroute.block_hashes` runs for int32 numpy arrays) and
//! `chain_ids`. Run: `cargo bench -p kvroute-bench`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvroute_core::keys::{block_hashes, block_hashes_u32, chain_ids};

fn tokens(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761) % 151_936).collect()
}

fn keys(c: &mut Criterion) {
    let mut g = c.benchmark_group("block_hashes");
    for n in [4_096, 65_536, 200_000] {
        let u = tokens(n);
        let s: Vec<i32> = u.iter().map(|&t| t as i32).collect();
        g.throughput(Throughput::Elements(n as u64));
        g.bench_function(BenchmarkId::new("u32", n), |b| {
            b.iter(|| block_hashes_u32(black_box(&u), 512));
        });
        g.bench_function(BenchmarkId::new("i32_checked", n), |b| {
            b.iter(|| block_hashes(black_box(&s), 512));
        });
    }
    g.finish();
    let ids: Vec<u64> = (0..256).collect();
    c.bench_function("chain_ids/256", |b| b.iter(|| chain_ids(black_box(&ids))));
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sample_size(50);
    targets = keys
}
criterion_main!(benches);
