//! Warm workloads shared by the criterion benches of `kvroute-core` (`cargo bench -p
//! kvroute-bench`). Not a public API; `publish = false`.
//!
//! The workload mirrors `benches/workload.py` (the Python benches):
//!
//! - 1024 sessions (conversations) in every cell, in 16 groups;
//!   the sessions of a group share a system prompt of `min(4, keys / 4)` blocks, then diverge.
//! - Background load: `2 × instances` short requests (4 blocks) stay in flight (half of them
//!   past their first token), so the policies score real, non-zero loads. Routed first.
//! - Warm-up routes every session twice (half its prefix, then the whole `keys - 1` block
//!   prefix) with `instances` warm-up requests in flight (finished first in, first out), so
//!   the sessions spread over the instances, and every cache model is warm (checked: every
//!   prefix is fully cached somewhere).
//! - A benchmarked call routes the next session (round robin) with `keys` keys: its warm
//!   `keys - 1` block prefix plus one new block (a fresh key on every call, as a regenerated
//!   or edited last turn), then the request is finished outside the timed region.
//!
//! Criterion runs millions of calls and revisits every session many times, each time with a
//! fresh last key, so the cache models are bounded (see [`WarmRouter::new`]): in steady state
//! each call evicts one stale last-turn key and the session prefixes stay resident, so the
//! cache holds about as many keys as in the Python benches (which visit each session once).

use std::hint::black_box;
use std::time::{Duration, Instant};

use kvroute_core::cache::{ClusterCache, PrefixWalk};
use kvroute_core::events::{EventBatch, KvEvent, StoredBlocks};
use kvroute_core::keys::{block_hashes_u32, chain_ids};
use kvroute_core::{CacheView, Id, Policy, Router, RouterConfig};

/// Tokens per block, the default of `kvroute.Router`.
pub const BLOCK_SIZE: u64 = 512;

/// Blocks of each background request (short, so the cache holds about as many keys in every
/// cell).
const BACKGROUND_BLOCKS: usize = 4;

/// Groups of sessions that share a system prompt.
const GROUPS: u64 = 16;

/// SplitMix64's finaliser: a cheap bijective mixer for synthetic block contents.
pub fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Number of sessions: the same in every cell (so the cache holds the same number of keys
/// whatever the instance count), and at least one per instance.
pub fn sessions_for(instances: usize) -> usize {
    instances.max(1024)
}

/// Prefix-chained keys of session `s`'s first `len` blocks. Blocks below `shared` are the
/// system prompt of the session's group, so sessions of one group share those keys.
pub fn session_chain(s: usize, len: usize, shared: usize) -> Vec<u64> {
    let s = s as u64;
    let group = s % GROUPS;
    let contents: Vec<u64> = (0..len as u64)
        .map(|j| {
            if (j as usize) < shared {
                mix((1 << 62) | (group << 32) | j)
            } else {
                mix((2 << 62) | (s << 24) | j)
            }
        })
        .collect();
    chain_ids(&contents)
}

/// [`session_chain`] as token blocks: the keys `block_hashes` gives session `s`'s first `len`
/// blocks of `BLOCK_SIZE` tokens, and those tokens. Block contents are as in `session_chain`.
pub fn session_tokens(s: usize, len: usize, shared: usize) -> (Vec<u64>, Vec<u32>) {
    let contents = session_chain(s, len, shared); // distinct per block, shared where it should be
    let tokens: Vec<u32> = contents
        .iter()
        .flat_map(|&c| (0..BLOCK_SIZE as u32).map(move |t| (c as u32) ^ t.wrapping_mul(0x9E37_79B9)))
        .collect();
    (block_hashes_u32(&tokens, BLOCK_SIZE as usize), tokens)
}

/// The batch an engine publishes after storing blocks `from..to` of session `s` (engine
/// hashes: the keys salted with the instance, as another engine's hash function would give).
pub fn stored_batch(s: usize, keys: usize, shared: usize, inst: usize, from: usize, to: usize) -> EventBatch {
    let (chain, tokens) = session_tokens(s, keys, shared);
    let salt = mix(inst as u64 + 1);
    let bs = BLOCK_SIZE as usize;
    let event = KvEvent::Stored(StoredBlocks {
        hashes: chain[from..to].iter().map(|k| k ^ salt).collect(),
        parent: from.checked_sub(1).map(|p| chain[p] ^ salt),
        token_ids: tokens[from * bs..to * bs].to_vec(),
        block_size: BLOCK_SIZE as u32,
        ignored: None,
    });
    EventBatch { ts: 0.0, events: if from < to { vec![event] } else { vec![] }, rank: 0 }
}

/// Blocks of the shared system prompt for requests of `keys` keys.
pub fn shared_blocks(keys: usize) -> usize {
    (keys / 4).min(4)
}

/// A warm router and the sessions to route next.
pub struct WarmRouter {
    /// The router under test.
    pub router: Router,
    /// Per session: its `keys`-block request; the last slot is rewritten on every call.
    chains: Vec<Vec<u64>>,
    next_session: usize,
    next_id: i64,
    fresh: u64,
}

impl WarmRouter {
    /// A router with `instances` instances and `policy`, warmed as the module docs say.
    ///
    /// The cache capacity comes from a probe: the same warm-up on an unbounded router gives
    /// the most keys any instance holds (`max`); the real router gets `max` plus room for one
    /// stale last-turn key per session and some slack. That evicts nothing during warm-up (so
    /// both warm-ups place the sessions alike) and, in steady state, only stale last-turn
    /// keys: a session's prefix is touched once per cycle over the sessions, and the cache
    /// keeps every key touched in the last cycle.
    pub fn new(instances: usize, keys: usize, policy: Policy) -> Self {
        Self::with_view(instances, keys, policy, CacheView::Estimate)
    }

    /// [`WarmRouter::new`] with `view`. With the events view, the sessions' blocks are token
    /// blocks (so that events can carry them), each warm-up route is followed by the batch
    /// its engine would publish (a `BlockStored` of the blocks it did not hold), and routed
    /// blocks stay pending for 50 ms (about a prefill: confirmed or forgotten by then).
    pub fn with_view(instances: usize, keys: usize, policy: Policy, view: CacheView) -> Self {
        assert!(keys >= 2, "a request needs a prefix and one new block");
        let probe = Self::warmed(instances, keys, policy, None, view);
        let max = probe.router.state().iter().map(|s| s.cached_blocks).max().unwrap_or(0);
        // Slack independent of the instance count, so stale keys do not pile up with it.
        let capacity = max + 2 * max.div_ceil(keys - 1) + 8;
        Self::warmed(instances, keys, policy, Some(capacity), view)
    }

    fn warmed(
        instances: usize,
        keys: usize,
        policy: Policy,
        capacity: Option<usize>,
        view: CacheView,
    ) -> Self {
        let sessions = sessions_for(instances);
        let shared = shared_blocks(keys);
        let config = RouterConfig {
            cache_capacity_blocks: capacity,
            cache_view: view,
            pending_ttl: Duration::from_millis(50),
            ..RouterConfig::default()
        };
        let mut router = Router::new(instances, policy, config).expect("valid config");
        let events = view == CacheView::Events;
        let mut seqs = vec![0u64; instances];
        if events {
            for (i, seq) in seqs.iter_mut().enumerate() {
                router
                    .apply_kv_events(
                        i as i64,
                        0,
                        &EventBatch { ts: 0.0, events: vec![], rank: 0 },
                        false,
                        None,
                    )
                    .expect("instance");
                *seq = 1;
            }
        }
        let chains: Vec<Vec<u64>> = (0..sessions)
            .map(|s| if events { session_tokens(s, keys, shared).0 } else { session_chain(s, keys, shared) })
            .collect();
        let mut next_id: i64 = 0;
        // Background first, so the warm-up already sees non-zero loads (with all loads at
        // zero, `lmetric` would put every session on instance 0).
        for b in 0..2 * instances {
            let chain = session_chain(1_000_000 + b, BACKGROUND_BLOCKS, 0);
            let id = Id::Int(next_id);
            next_id += 1;
            let len = chain.len() as u64 * BLOCK_SIZE;
            router.route(id.clone(), &chain, len, Some(&Id::Int(-1 - b as i64))).expect("background route");
            if b % 2 == 0 {
                router.first_token(&id);
            }
        }
        // Warm-up with `instances` requests in flight (finished first in, first out), as under
        // real concurrency: the in-flight ones raise their instances' scores, so sessions
        // spread instead of all tying on the same idle instance.
        let prefix = keys - 1;
        let mut window = std::collections::VecDeque::with_capacity(instances + 1);
        for cut in [prefix.div_ceil(2), prefix] {
            for (s, chain) in chains.iter().enumerate() {
                let id = Id::Int(next_id);
                next_id += 1;
                let len = cut as u64 * BLOCK_SIZE;
                let held = router.estimate_cache_hits_in(&chain[..cut], len, Some(CacheView::Events));
                let d = router
                    .route(id.clone(), &chain[..cut], len, Some(&Id::Int(s as i64)))
                    .expect("warm-up route");
                if events {
                    let from = (held[d.instance] / BLOCK_SIZE) as usize;
                    let batch = stored_batch(s, keys, shared, d.instance, from, cut);
                    router
                        .apply_kv_events(d.instance as i64, seqs[d.instance], &batch, false, None)
                        .expect("apply");
                    seqs[d.instance] += 1;
                }
                window.push_back(id);
                if window.len() > instances {
                    router.finish(&window.pop_front().expect("non-empty"));
                }
            }
        }
        for id in window {
            router.finish(&id);
        }
        let warm = Self { router, chains, next_session: 0, next_id, fresh: 0 };
        assert_eq!(warm.cold_sessions(), 0, "every session prefix must be cached after warm-up");
        warm
    }

    /// Sessions whose `keys - 1` block prefix is not fully cached on any instance: 0 after
    /// the warm-up, and still 0 after any number of calls when the cache bound is right.
    pub fn cold_sessions(&self) -> usize {
        let prefix = self.chains[0].len() - 1;
        let full = prefix as u64 * BLOCK_SIZE;
        self.chains
            .iter()
            .filter(|c| self.router.estimate_cache_hits(&c[..prefix], full).into_iter().max() != Some(full))
            .count()
    }

    /// Route the next request (next session: its warm prefix plus a fresh last block, all
    /// blocks full except a 300-token last one), finish it, and return the time `route`
    /// alone took: building the request and `finish` are outside the clock.
    pub fn route_next_timed(&mut self) -> Duration {
        let s = self.next_session;
        self.next_session = (s + 1) % self.chains.len();
        let id = Id::Int(self.next_id);
        self.next_id += 1;
        self.fresh += 1;
        let chain = &mut self.chains[s];
        let last = chain.len() - 1;
        chain[last] = mix((3 << 62) ^ self.fresh);
        let session = Id::Int(s as i64);
        let input_length = last as u64 * BLOCK_SIZE + 300;
        let start = Instant::now();
        let decision = self.router.route(id.clone(), black_box(chain), input_length, Some(&session));
        let elapsed = start.elapsed();
        black_box(decision.expect("route"));
        self.router.finish(&id);
        elapsed
    }
}

/// A warm cluster cache (no router) and the prefixes to look up.
pub struct WarmCache {
    /// The cache under test.
    pub cache: ClusterCache,
    /// Per session: its prefix plus one key no instance holds.
    pub lookups: Vec<Vec<u64>>,
}

impl WarmCache {
    /// `sessions_for(instances)` sessions of `keys - 1` cached blocks, session `s` on
    /// instance `s % instances`, each looked up with one extra, uncached block.
    pub fn new(instances: usize, keys: usize) -> Self {
        assert!(keys >= 2, "a lookup needs a prefix and one new block");
        let sessions = sessions_for(instances);
        let shared = shared_blocks(keys);
        let mut cache = ClusterCache::new(instances, None);
        let lookups: Vec<Vec<u64>> = (0..sessions)
            .map(|s| {
                let mut chain = session_chain(s, keys, shared);
                cache.touch_request(s % instances, &chain[..keys - 1], &PrefixWalk::default());
                chain[keys - 1] = mix((3 << 62) ^ s as u64);
                chain
            })
            .collect();
        Self { cache, lookups }
    }
}

/// Parse a policy name the benches use.
pub fn policy(name: &str) -> Policy {
    Policy::from_name(name).expect("known policy")
}
