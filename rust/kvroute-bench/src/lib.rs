//! Warm workloads shared by the criterion benches of `kvroute-core` (`cargo bench -p
//! kvroute-bench`). Not a public API; `publish = false`.
//!
//! The workload mirrors `benches/workload.py` (the Python benches):
//!
//! - `sessions` conversations (at least 512, and at least one per instance), in 16 groups;
//!   the sessions of a group share a system prompt of `min(4, keys / 4)` blocks, then diverge.
//! - Background load: `2 × instances` requests stay in flight (half of them past their first
//!   token), so the policies score real, non-zero loads. They are routed first.
//! - Warm-up routes every session twice (half its prefix, then the whole `keys - 1` block
//!   prefix) and finishes each request, so the unified policy spreads the sessions over the
//!   instances and every cache model is warm (checked: every prefix is fully cached).
//! - A benchmarked call routes the next session (round robin) with `keys` keys: its warm
//!   `keys - 1` block prefix plus one new block (a fresh key on every call, as a regenerated
//!   or edited last turn), then the request is finished outside the timed region.
//!
//! Criterion runs millions of calls, so every call adds one fresh key: the cache models are
//! bounded (`cache_capacity_blocks` = four times the warm keys of an even spread) and evict those stale
//! last-turn keys in steady state, while the session prefixes stay resident.

use std::hint::black_box;
use std::time::{Duration, Instant};

use kvroute_core::cache::ClusterCache;
use kvroute_core::keys::chain_ids;
use kvroute_core::{Id, Policy, Router, RouterConfig};

/// Tokens per block, the default of `kvroute.Router`.
pub const BLOCK_SIZE: u64 = 512;

/// Groups of sessions that share a system prompt.
const GROUPS: u64 = 16;

/// SplitMix64's finaliser: a cheap bijective mixer for synthetic block contents.
pub fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Number of sessions for a cell: a few hundred, and at least one per instance.
pub fn sessions_for(instances: usize) -> usize {
    instances.max(512)
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
    pub fn new(instances: usize, keys: usize, policy: Policy) -> Self {
        assert!(keys >= 2, "a request needs a prefix and one new block");
        let sessions = sessions_for(instances);
        let shared = shared_blocks(keys);
        // Room for twice the warm keys of an even spread, and then some: prefixes stay resident,
        // stale last-turn keys get evicted in steady state.
        let warm_per_instance = sessions.div_ceil(instances) * keys;
        let config = RouterConfig {
            cache_capacity_blocks: Some(4 * warm_per_instance + 8 * keys),
            ..RouterConfig::default()
        };
        let mut router = Router::new(instances, policy, config).expect("valid config");
        let chains: Vec<Vec<u64>> = (0..sessions)
            .map(|s| session_chain(s, keys, shared))
            .collect();
        let mut next_id: i64 = 0;
        // Background first, so the warm-up already sees non-zero loads (with all loads at
        // zero, `lmetric` would put every session on instance 0).
        for b in 0..2 * instances {
            let chain = session_chain(1_000_000 + b, keys.div_ceil(2), 0);
            let id = Id::Int(next_id);
            next_id += 1;
            let len = chain.len() as u64 * BLOCK_SIZE;
            router
                .route(id.clone(), &chain, len, Some(&Id::Int(-1 - b as i64)))
                .expect("background route");
            if b % 2 == 0 {
                router.first_token(&id);
            }
        }
        let prefix = keys - 1;
        for cut in [prefix.div_ceil(2), prefix] {
            for (s, chain) in chains.iter().enumerate() {
                let id = Id::Int(next_id);
                next_id += 1;
                let len = cut as u64 * BLOCK_SIZE;
                router
                    .route(id.clone(), &chain[..cut], len, Some(&Id::Int(s as i64)))
                    .expect("warm-up route");
                router.finish(&id);
            }
        }
        let full = prefix as u64 * BLOCK_SIZE;
        let cold = chains
            .iter()
            .filter(|c| {
                router
                    .estimate_cache_hits(&c[..prefix], full)
                    .into_iter()
                    .max()
                    != Some(full)
            })
            .count();
        assert_eq!(cold, 0, "every session prefix must be cached after warm-up");
        Self {
            router,
            chains,
            next_session: 0,
            next_id,
            fresh: 0,
        }
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
        let decision =
            self.router
                .route(id.clone(), black_box(chain), input_length, Some(&session));
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
                cache.touch_request(s % instances, &chain[..keys - 1]);
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
