//! Cross-checks of the three passes and the multi-capacity LRU against a direct, slow
//! reading of SEMANTICS §4 (tries of key paths as sets of prefixes; one LRU per capacity),
//! on seeded random traces with chained and unchained ids, shared prefixes and branches.

use std::collections::{HashMap, HashSet, VecDeque};

use super::*;
use crate::rng::SplitMix64;

fn naive(trace: &Trace<'_>, p: &Params) -> Ceilings {
    let b = p.block_size;
    let mut sessions_of: HashMap<Vec<u64>, HashSet<u32>> = HashMap::new();
    for (row, keys) in trace.keys.iter().enumerate() {
        for j in 0..keys.len() {
            sessions_of.entry(keys[..=j].to_vec()).or_default().insert(trace.session[row]);
        }
    }
    let mut any_trie: HashSet<Vec<u64>> = HashSet::new();
    let mut intra_trie: HashMap<u32, HashSet<Vec<u64>>> = HashMap::new();
    let mut out = Ceilings::default();
    let mut per = PerRequest {
        any: vec![0; trace.keys.len()],
        intra: vec![0; trace.keys.len()],
        shared: vec![0; trace.keys.len()],
        capacity: Vec::new(),
    };
    for &row in &trace.order {
        let r = row as usize;
        let (keys, len, s) = (trace.keys[r], trace.input_length[r], trace.session[r]);
        let mine = intra_trie.entry(s).or_default();
        let ka = (0..keys.len()).take_while(|&j| any_trie.contains(&keys[..=j])).count();
        let ki = (0..keys.len()).take_while(|&j| mine.contains(&keys[..=j])).count();
        let ks =
            (1..=ka).rev().find(|&l| sessions_of[&keys[..l]].len() >= p.min_sessions as usize).unwrap_or(0);
        for j in 0..ka {
            let t = ((j as u64 + 1) * b).min(len).saturating_sub(j as u64 * b);
            if mine.contains(&keys[..=j]) {
                out.reuse.intra += t;
            } else if sessions_of[&keys[..=j]].len() >= p.min_sessions as usize {
                out.reuse.shared += t;
            } else {
                out.reuse.cross += t;
            }
        }
        out.any.record(ka as u64, b, len);
        out.intra.record(ki as u64, b, len);
        out.shared.record(ks as u64, b, len);
        (per.any[r], per.intra[r], per.shared[r]) = (ka as u32, ki as u32, ks as u32);
        for j in 0..keys.len() {
            any_trie.insert(keys[..=j].to_vec());
            mine.insert(keys[..=j].to_vec());
        }
    }
    let mut caps = p.capacities.clone();
    caps.sort_unstable();
    caps.dedup();
    for &c in &caps {
        let mut lru: VecDeque<u64> = VecDeque::new();
        let mut t = Totals::default();
        let mut col = vec![0u32; trace.keys.len()];
        for &row in &trace.order {
            let keys = trace.keys[row as usize];
            let k = keys.iter().take_while(|k| lru.contains(k)).count();
            t.record(k as u64, b, trace.input_length[row as usize]);
            col[row as usize] = k as u32;
            for &key in keys.iter().rev() {
                lru.retain(|&x| x != key);
                lru.push_front(key);
                lru.truncate(c as usize);
            }
        }
        out.capacity.push((c, t));
        per.capacity.push(col);
    }
    if p.per_request {
        out.per_request = Some(per);
    }
    out
}

/// A random trace: sessions grow conversations from shared system prompts, sometimes
/// branch back, and draw from a small id alphabet when `unchained`.
fn random_trace(seed: u64, rows: usize, unchained: bool) -> (Vec<Vec<u64>>, Trace<'static>) {
    let mut rng = SplitMix64::new(seed);
    let sessions = 1 + rng.below(12);
    let prompts: Vec<Vec<u64>> =
        (0..3).map(|_| (0..rng.below(5)).map(|_| rng.next_u64() % 1000).collect()).collect();
    let mut ctx: Vec<Vec<u64>> = (0..sessions).map(|s| prompts[s % 3].clone()).collect();
    let mut keys = Vec::new();
    let mut session = Vec::new();
    let mut ts = Vec::new();
    let mut lens = Vec::new();
    for _ in 0..rows {
        let s = rng.below(sessions);
        let c = &mut ctx[s];
        match rng.below(6) {
            0 => c.truncate(rng.below(c.len() + 1)),
            1 => *c = prompts[rng.below(3)].clone(),
            _ => {}
        }
        for _ in 0..rng.below(4) {
            c.push(if unchained { rng.next_u64() % 4 } else { rng.next_u64() });
        }
        keys.push(c.clone());
        session.push(s as u32);
        ts.push(rng.below(rows / 2 + 1) as f64);
        let blocks = c.len() as u64;
        lens.push(if blocks == 0 { rng.below(3) as u64 } else { blocks * 4 - rng.below(5) as u64 });
    }
    let order = stable_order(&ts).unwrap();
    let leaked: &'static [Vec<u64>] = Box::leak(keys.clone().into_boxed_slice());
    let trace = Trace {
        keys: leaked.iter().map(|k| k.as_slice()).collect(),
        input_length: lens,
        session,
        num_sessions: sessions,
        order,
    };
    (keys, trace)
}

#[test]
fn matches_naive_reading() {
    for seed in 0..300u64 {
        let (_, trace) = random_trace(seed, 1 + (seed as usize * 7) % 120, seed % 2 == 0);
        let params = Params {
            block_size: 4,
            min_sessions: 1 + (seed % 4) as u32,
            capacities: vec![1, 2, 3, 5, 8, 13, 40, 7, 2],
            per_request: true,
        };
        let got = compute_simple(&trace, &params).unwrap();
        let want = naive(&trace, &params);
        assert_eq!(got, want, "seed {seed}");
        let r = got.reuse;
        assert_eq!(r.intra + r.cross + r.shared, got.any.hit_tokens);
    }
}

#[test]
fn matches_naive_reading_with_many_shards() {
    for seed in [11u64, 12] {
        let (_, trace) = random_trace(seed, 40_000, seed % 2 == 0);
        let params = Params { block_size: 4, min_sessions: 2, capacities: vec![3, 50], per_request: true };
        assert_eq!(compute_simple(&trace, &params).unwrap(), naive(&trace, &params), "seed {seed}");
    }
}

#[test]
fn empty_and_single() {
    let empty = Trace::default();
    let got = compute_simple(&empty, &Params { capacities: vec![3], ..Params::default() }).unwrap();
    assert_eq!(got.any, Totals::default());
    assert_eq!(got.capacity, vec![(3, Totals::default())]);
    let keys = [1u64, 2, 3];
    let one = Trace {
        keys: vec![&keys],
        input_length: vec![1500],
        session: vec![0],
        num_sessions: 1,
        order: vec![0],
    };
    let got = compute_simple(&one, &Params::default()).unwrap();
    assert_eq!(got.any.hit_tokens, 0);
    assert_eq!(got.any.total_tokens, 1500);
    assert_eq!(got.any.total_requests, 1);
}

#[test]
fn rejects_bad_input() {
    let keys = [1u64];
    let mut t =
        Trace { keys: vec![&keys], input_length: vec![1], session: vec![0], num_sessions: 1, order: vec![1] };
    assert!(matches!(compute_simple(&t, &Params::default()), Err(Stop::Invalid(_))));
    t.order = vec![0];
    let zero = Params { capacities: vec![0], ..Params::default() };
    assert!(matches!(compute_simple(&t, &zero), Err(Stop::Invalid(_))));
    assert!(stable_order(&[0.0, f64::NAN]).is_err());
    assert_eq!(stable_order(&[2.0, 1.0, 2.0, 1.0]).unwrap(), vec![1, 3, 0, 2]);
}

#[test]
fn cancel_stops() {
    let (_, trace) = random_trace(7, 200, false);
    let ctl = Control::default();
    ctl.cancel();
    assert_eq!(compute(&trace, &Params::default(), &ctl), Err(Stop::Cancelled));
}
