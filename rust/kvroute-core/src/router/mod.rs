//! The router: per-instance counters, the cache model, session affinity and the request
//! state machine (route → first_token → finish) of the semantics page, §2–3.
//!
//! `route` costs one cluster-index walk over the request's keys (policies that score the
//! cache), one pass over the instances, and one touch per key on the chosen instance:
//! O(keys + instances); under a token cap or Dynamo's cost with a `dedup_weight`, also one
//! hash update per key to count the blocks held in flight (`held`), and the cost looks up,
//! per instance, the request's leading keys held there. `first_token` is O(1), `finish` O(1)
//! (O(keys) where blocks held are counted). The touch can go to a worker thread instead
//! ([`Router::touch_through`], same results). Not synchronised: wrap it in a lock to share
//! it between threads (the Python binding does).
//!
//! `config`: ids, the cache rule and view, [`RouterConfig`]; `instances`: availability and
//! each instance's cache model; `kv_events`: the engines' KV-cache events view;
//! `engine_load`: the engines' own reports of their load, and overload.

use std::sync::Arc;

use rustc_hash::FxHashMap;

use crate::background::CacheCell;
pub use crate::background::{TouchJob, TouchSink};
use crate::cache::{ClusterCache, PrefixWalk};
use crate::error::{Error, Result};
use crate::events::EventView;
use crate::keys::hit_tokens;
use crate::picker::{pick, Branch, InstanceLoad, PickInput, PickState};
use crate::policy::{Policy, TtftCosts};
use crate::rng::SplitMix64;
use crate::sessions::{shared_affinity, Affinity};

mod config;
mod engine_load;
mod held;
mod instances;
mod kv_events;

pub use config::{
    CacheRule, CacheView, Id, LoadSource, RouterConfig, DEFAULT_PENDING_TTL, MAX_INPUT_LENGTH, MAX_INSTANCES,
};
pub use engine_load::{EngineLoad, OverloadRule};
use kv_events::merge;

/// The outcome of one `route`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// The chosen instance.
    pub instance: usize,
    /// Estimated cached tokens on it before this request.
    pub hit_tokens: u64,
    /// `input_length - hit_tokens`: the prefill this request adds there.
    pub new_prefill: u64,
    /// Why it was chosen.
    pub branch: Branch,
}

/// Snapshot of one instance.
#[derive(Debug, Clone, PartialEq)]
pub struct InstanceState {
    /// The counters.
    pub load: InstanceLoad,
    /// Keys resident in the cache view routing reads for it.
    pub cached_blocks: usize,
    /// That view: `"estimate"`, `"events"`, or `"degraded"` (the events view is not whole:
    /// the estimate).
    pub cache_view: &'static str,
    /// Its engine's last report of its own load, if any (`engine_load`).
    pub engine: Option<EngineLoad>,
    /// Whether the overload rule leaves it out while another is not overloaded.
    pub overloaded: bool,
}

#[derive(Debug, Clone)]
struct InFlight {
    instance: usize,
    input_length: u64,
    new_prefill: u64,
    first_token_seen: bool,
    /// The keys it holds there, where the router counts the blocks held in flight.
    held: Box<[u64]>,
}

/// A KV-cache-aware router over a set of instances.
#[derive(Debug, Clone)]
pub struct Router {
    policy: Policy,
    config: RouterConfig,
    loads: Vec<InstanceLoad>,
    cache: CacheCell,
    requests: FxHashMap<Id, InFlight>,
    affinity: Affinity,
    state: PickState,
    walk: PrefixWalk,
    /// The events view (with [`CacheView::Events`]) and its walk's and the merged matches.
    events: Option<EventView>,
    event_matched: Vec<u32>,
    merged: Vec<u32>,
    /// Σ num_requests and the number of instances, over the available instances (kept up to
    /// date, so `unified`'s gate reads the average in O(1)).
    available_totals: (u64, u64),
    /// The engines' own reports of their load, and the overload rule.
    engine: engine_load::EngineLoads,
    /// The loads the policies read when they are not the router's own (`engine_load`).
    seen: Vec<InstanceLoad>,
    /// The blocks held in flight, a shared one once, under a token cap or for Dynamo's cost
    /// under a `dedup_weight` (`held`).
    held: held::HeldBlocks,
}

/// A policy's pick before it is counted: the instance, why, the blocks of the request it
/// holds, and how many of the request's keys it will hold.
struct Choice {
    instance: usize,
    branch: Branch,
    matched: usize,
    stored: usize,
}

impl Router {
    /// A router over `num_instances` available instances with empty caches.
    pub fn new(num_instances: usize, policy: Policy, config: RouterConfig) -> Result<Self> {
        if num_instances > MAX_INSTANCES {
            return Err(Error::InvalidArgument(format!(
                "num_instances must be at most {MAX_INSTANCES}, got {num_instances}"
            )));
        }
        if config.block_size == 0 {
            return Err(Error::InvalidArgument("block_size must be positive, got 0".into()));
        }
        if config.cache_capacity_blocks == Some(0) {
            return Err(Error::InvalidArgument(
                "cache_capacity_blocks must be positive or None (unbounded), got 0".into(),
            ));
        }
        config.params.validate_for(policy)?;
        let mut held = held::HeldBlocks::default();
        held.track(policy.reads_held(&config.params), num_instances);
        Ok(Self {
            policy,
            loads: vec![InstanceLoad { available: true, ..InstanceLoad::default() }; num_instances],
            cache: CacheCell::new(ClusterCache::new(num_instances, config.cache_capacity_blocks)),
            requests: FxHashMap::default(),
            affinity: Affinity::new(config.max_sessions),
            state: PickState { rr: 0, rng: SplitMix64::new(config.seed), tied: Vec::new() },
            walk: PrefixWalk::default(),
            events: (config.cache_view == CacheView::Events)
                .then(|| EventView::new(num_instances, config.block_size, config.pending_ttl)),
            event_matched: Vec::new(),
            merged: Vec::new(),
            available_totals: (0, num_instances as u64),
            engine: engine_load::EngineLoads::new(num_instances),
            held,
            seen: Vec::new(),
            config,
        })
    }

    /// The policy in use.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// The configuration in use.
    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// Predict `ttft`'s times with `costs` from now on (costs refitted while serving);
    /// checked as at construction.
    pub fn set_ttft_costs(&mut self, costs: TtftCosts) -> Result<()> {
        costs.validate()?;
        self.config.params.ttft_costs = Some(costs);
        Ok(())
    }

    /// Number of instances ever added (indices `0..n`).
    pub fn num_instances(&self) -> usize {
        self.loads.len()
    }

    /// Number of requests in flight.
    pub fn in_flight(&self) -> usize {
        self.requests.len()
    }

    /// The instance `request` is counted on while it is in flight.
    pub fn instance_of(&self, request: &Id) -> Option<usize> {
        self.requests.get(request).map(|r| r.instance)
    }

    /// Pick an instance for a request and count it there (semantics §2 step 1), among the
    /// available instances that are not overloaded while there are some (`engine_load`).
    pub fn route(
        &mut self,
        request: Id,
        keys: &[u64],
        input_length: u64,
        session: Option<&Id>,
    ) -> Result<Decision> {
        let hidden = self.hide_overloaded();
        let decision = self.route_among(request, keys, input_length, session);
        self.restore(&hidden);
        if let Ok(d) = &decision {
            self.engine.sent_to(d.instance, input_length, d.new_prefill);
        }
        decision
    }

    /// [`Router::route`] bound to instance `only` (admission's preferred engine): when every
    /// available instance has room the policy's pick is `only` itself and this is a plain
    /// route (its tie counter moves as without admission); otherwise the others sit out this
    /// one decision.
    pub fn route_on(
        &mut self,
        only: usize,
        request: Id,
        keys: &[u64],
        input_length: u64,
        session: Option<&Id>,
    ) -> Result<Decision> {
        let n = self.num_instances();
        let others: Vec<usize> = match (0..n).all(|i| !self.is_available(i) || self.has_room_on(i)) {
            true => Vec::new(),
            false => (0..n).filter(|&i| i != only).collect(),
        };
        self.route_excluding(&others, request, keys, input_length, session)
    }

    /// [`Router::route`] with the instances in `excluded` sitting out this one decision (a
    /// retry's backends already tried; admission's binding).
    pub fn route_excluding(
        &mut self,
        excluded: &[usize],
        request: Id,
        keys: &[u64],
        input_length: u64,
        session: Option<&Id>,
    ) -> Result<Decision> {
        let hidden: Vec<usize> = excluded.iter().copied().filter(|&i| self.is_available(i)).collect();
        for &i in &hidden {
            self.set_available(i as i64, false)?;
        }
        let decision = self.route(request, keys, input_length, session);
        for &i in &hidden {
            self.set_available(i as i64, true)?;
        }
        decision
    }

    fn route_among(
        &mut self,
        request: Id,
        keys: &[u64],
        input_length: u64,
        session: Option<&Id>,
    ) -> Result<Decision> {
        if self.requests.contains_key(&request) {
            return Err(Error::DuplicateRequest(request.to_string()));
        }
        if input_length > MAX_INPUT_LENGTH {
            return Err(Error::InvalidArgument(format!(
                "input_length must be at most 2**40 tokens, got {input_length}"
            )));
        }
        let saved = (self.state.rr, self.state.rng.clone());
        let Choice { instance, branch, matched, stored } = self.choose(keys, input_length, session)?;
        let hit = hit_tokens(matched as u64, self.config.block_size, input_length);
        let new_prefill = input_length - hit;
        let load = &mut self.loads[instance];
        let (Some(ongoing), Some(pending)) = (
            load.ongoing_tokens.checked_add(input_length),
            load.pending_prefill_tokens.checked_add(new_prefill),
        ) else {
            (self.state.rr, self.state.rng) = saved;
            return Err(Error::InvalidArgument(format!(
                "input_length {input_length} would overflow instance {instance}'s token counters"
            )));
        };
        load.num_requests += 1;
        self.available_totals.0 += 1; // a picked instance is available
        load.ongoing_tokens = ongoing;
        load.pending_prefill_tokens = pending;
        match self.events.as_mut().filter(|e| e.uses_events(instance)) {
            // Its matched prefix is held there already; the rest is pending from now.
            Some(e) => e.predict(instance, &keys[matched.min(stored)..stored]),
            None => self.cache.touch(instance, &keys[..stored], &mut self.walk),
        }
        if let (Some(s), true) = (session, self.uses_affinity() && !self.config.shared_affinity) {
            self.affinity.set(s, instance);
        }
        let held: Box<[u64]> = match self.held.tracking() {
            true => {
                self.held.add(instance, &keys[..stored]);
                keys[..stored].into()
            }
            false => Box::default(),
        };
        self.requests
            .insert(request, InFlight { instance, input_length, new_prefill, first_token_seen: false, held });
        Ok(Decision { instance, hit_tokens: hit, new_prefill, branch })
    }

    /// The instance the policy picks for this request among every available instance,
    /// overloaded ones included, without routing it (nothing is counted, the tie counter and
    /// the RNG are left as they were); None when no instance is available. Admission binds a
    /// waiting request to it. O(keys + instances).
    pub fn preferred(&mut self, keys: &[u64], input_length: u64, session: Option<&Id>) -> Option<usize> {
        let saved = (self.state.rr, self.state.rng.clone());
        let chosen = self.choose(keys, input_length.min(MAX_INPUT_LENGTH), session).ok();
        (self.state.rr, self.state.rng) = saved;
        chosen.map(|c| c.instance)
    }

    /// The policy's pick among the available instances, and what it matched there.
    fn choose(&mut self, keys: &[u64], input_length: u64, session: Option<&Id>) -> Result<Choice> {
        let shared = self.config.shared_affinity && session.is_some() && self.uses_affinity();
        let (lookup, stored) =
            self.config.cache_rule.limits(keys.len(), input_length, self.config.block_size);
        let (loads, available_totals) = match self.policy_loads() {
            true => {
                let seen = &self.seen;
                let available = seen.iter().filter(|l| l.available);
                (seen, available.fold((0, 0), |(s, c), l| (s + l.num_requests, c + 1)))
            }
            false => (&self.loads, self.available_totals),
        };
        let cache = self.cache.lock();
        let events = self.events.as_ref();
        let on_events = |i: usize| events.is_some_and(|e| e.uses_events(i));
        if self.policy.scores_cache() || shared {
            let every = events.is_some_and(|_| (0..self.loads.len()).all(on_events));
            if every {
                self.walk.clear();
            } else {
                cache.walk(&keys[..lookup], &mut self.walk);
            }
            if let Some(e) = events {
                e.walk(&keys[..lookup], &mut self.event_matched);
                merge(&mut self.merged, &self.event_matched, self.walk.matched(), on_events);
            }
        } else {
            self.walk.clear();
            self.merged.clear();
        }
        let matched: &[u32] = if events.is_some() { &self.merged } else { self.walk.matched() };
        let affinity = match session {
            Some(s) if shared => shared_affinity(s, matched, &self.loads),
            Some(s) => self.affinity.get(s).filter(|&a| self.loads[a].available),
            None => None,
        };
        let input = PickInput {
            loads,
            matched,
            cached_blocks: &|i| match events {
                Some(e) if e.uses_events(i) => e.cached_blocks(i),
                _ => cache.cached_blocks(i),
            },
            input_length,
            block_size: self.config.block_size,
            held_again: &|i| {
                let blocks = self.held.shared_blocks(i) + self.held.held_prefix(i, &keys[..stored]);
                blocks.saturating_mul(self.config.block_size)
            },
            affinity,
            available_totals,
        };
        let (instance, branch) = pick(self.policy, &self.config.params, &input, &mut self.state)
            .ok_or(Error::NoInstanceAvailable)?;
        let matched = match matched.get(instance) {
            Some(&m) => m as usize,
            None => match events {
                Some(e) if e.uses_events(instance) => e.matched_blocks(instance, &keys[..lookup]),
                _ => cache.matched_blocks(instance, &keys[..lookup]),
            },
        };
        drop(cache);
        Ok(Choice { instance, branch, matched, stored })
    }

    /// The first token came back (§2 step 2). Returns whether anything changed.
    pub fn first_token(&mut self, request: &Id) -> bool {
        let Some(r) = self.requests.get_mut(request) else {
            return false;
        };
        if r.first_token_seen {
            return false;
        }
        r.first_token_seen = true;
        let load = &mut self.loads[r.instance];
        load.pending_prefill_tokens -= r.new_prefill;
        load.ongoing_decode_tokens += r.input_length;
        true
    }

    /// The engine stored more blocks for an in-flight request: `keys` are the request's
    /// whole sequence so far (prompt and output, full blocks only), touched on its instance
    /// from last to first. vLLM keeps the blocks a request's output completes, so the next
    /// turn of a conversation can hit them. Returns whether the request was in flight.
    /// O(keys).
    pub fn extend(&mut self, request: &Id, keys: &[u64]) -> bool {
        let Some(r) = self.requests.get(request) else {
            return false;
        };
        self.walk.clear();
        match self.events.as_mut().filter(|e| e.uses_events(r.instance)) {
            Some(e) => e.predict(r.instance, keys),
            None => self.cache.touch(r.instance, keys, &mut self.walk),
        }
        true
    }

    /// The request ended: success, error or abort (§2 step 3). Returns whether it was in flight.
    pub fn finish(&mut self, request: &Id) -> bool {
        let Some(r) = self.requests.remove(request) else {
            return false;
        };
        let load = &mut self.loads[r.instance];
        load.num_requests -= 1;
        if load.available {
            self.available_totals.0 -= 1;
        }
        load.ongoing_tokens -= r.input_length;
        if r.first_token_seen {
            load.ongoing_decode_tokens -= r.input_length;
        } else {
            load.pending_prefill_tokens -= r.new_prefill;
        }
        self.held.remove(r.instance, &r.held);
        true
    }

    /// Estimated cached tokens of a request on one instance; reads only.
    pub fn estimate_cache_hit(&self, instance: usize, keys: &[u64], input_length: u64) -> Result<u64> {
        self.check_instance(instance as i64)?;
        let keys = self.lookup(keys, input_length);
        let matched = match &self.events {
            Some(e) if e.uses_events(instance) => e.matched_blocks(instance, keys),
            _ => self.cache.lock().matched_blocks(instance, keys),
        };
        Ok(hit_tokens(matched as u64, self.config.block_size, input_length))
    }

    /// Estimated cached tokens on every instance, by the view routing reads for each
    /// (one walk per view); reads only.
    pub fn estimate_cache_hits(&self, keys: &[u64], input_length: u64) -> Vec<u64> {
        self.estimate_cache_hits_in(keys, input_length, None)
    }

    /// [`Router::estimate_cache_hits`] by one view for every instance (`Some`: the estimate
    /// view, or the events view whether or not routing reads it; a router without an events
    /// view holds nothing there), or as routing reads them (`None`).
    pub fn estimate_cache_hits_in(
        &self,
        keys: &[u64],
        input_length: u64,
        view: Option<CacheView>,
    ) -> Vec<u64> {
        let keys = self.lookup(keys, input_length);
        let mut walk = PrefixWalk::default();
        self.cache.lock().walk(keys, &mut walk);
        let mut merged = walk.matched().to_vec();
        match (&self.events, view) {
            (_, Some(CacheView::Estimate)) | (None, None) => {}
            (None, Some(CacheView::Events)) => merged.fill(0),
            (Some(e), view) => {
                let mut from_events = Vec::new();
                e.walk(keys, &mut from_events);
                let every = view == Some(CacheView::Events);
                merge(&mut merged, &from_events, walk.matched(), |i| every || e.uses_events(i));
            }
        }
        merged.iter().map(|&m| hit_tokens(u64::from(m), self.config.block_size, input_length)).collect()
    }

    /// From now on, hand the cache model's touches to `sink` whenever its worker thread is
    /// idle (results stay identical; see `background.rs`). For a caller with other work
    /// between routes and a core to spare, such as the simulator.
    pub fn touch_through(&mut self, sink: Arc<dyn TouchSink>) {
        self.cache.touch_through(sink);
    }

    /// The affinity instance of a session, if it has one.
    pub fn session_affinity(&self, session: &Id) -> Option<usize> {
        self.affinity.get(session)
    }

    /// Number of sessions with an affinity instance.
    pub fn num_sessions(&self) -> usize {
        self.affinity.len()
    }

    /// The keys of a request that may hit, by the cache rule.
    fn lookup<'k>(&self, keys: &'k [u64], input_length: u64) -> &'k [u64] {
        &keys[..self.config.cache_rule.limits(keys.len(), input_length, self.config.block_size).0]
    }

    fn uses_affinity(&self) -> bool {
        matches!(self.policy, Policy::Sticky | Policy::Unified | Policy::UnifiedDynamo)
    }

    fn check_instance(&self, instance: i64) -> Result<usize> {
        usize::try_from(instance)
            .ok()
            .filter(|&i| i < self.loads.len())
            .ok_or(Error::UnknownInstance { index: instance, count: self.loads.len() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vllm_router() -> Router {
        let config = RouterConfig { block_size: 32, cache_rule: CacheRule::Vllm, ..RouterConfig::default() };
        Router::new(1, Policy::Lmetric, config).unwrap()
    }

    /// vLLM keeps full blocks only and always recomputes a prompt's last token.
    #[test]
    fn the_vllm_rule_stores_full_blocks_and_recomputes_the_last_token() {
        let mut r = vllm_router();
        let keys = [1, 2, 3];
        for (id, n, hit) in [(0, 64u64, 0), (1, 64, 32), (2, 65, 64), (3, 96, 64), (4, 70, 64)] {
            assert_eq!(
                r.route(Id::Int(id), &keys[..n.div_ceil(32) as usize], n, None).unwrap().hit_tokens,
                hit
            );
            r.finish(&Id::Int(id));
        }
        assert_eq!(r.cached_keys(0).unwrap(), vec![1, 2, 3]); // the 96-token prompt's third block
        assert_eq!(CacheRule::Vllm.limits(3, 0, 32), (0, 0));
        assert_eq!(CacheRule::Trace.limits(3, 10, 32), (3, 3));
    }

    #[test]
    fn blocks_an_output_completes_can_hit_the_next_turn() {
        let mut r = vllm_router();
        r.route(Id::Int(1), &[1, 2], 40, None).unwrap(); // stores block 1 only
        assert!(r.extend(&Id::Int(1), &[1, 2, 3]));
        r.finish(&Id::Int(1));
        assert!(!r.extend(&Id::Int(1), &[9]));
        assert_eq!(r.estimate_cache_hit(0, &[1, 2, 3, 4], 120).unwrap(), 96);
        r.clear_cache(0).unwrap();
        assert_eq!(r.estimate_cache_hit(0, &[1, 2, 3, 4], 120).unwrap(), 0);
    }
}
