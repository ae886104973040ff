//! What each engine reports of its own load (its waiting and running requests and KV-cache
//! usage, read from its metrics by the caller), the overload rule built on it, and the load
//! the policies read with [`LoadSource::Engine`].
//!
//! Between two reads, the requests this router sent an engine since the last one count as
//! waiting there too (as SMG credits its dispatches), so that a burst does not all land on the
//! engine that looked idle. An engine is overloaded when that waiting count reaches the rule's
//! `waiting`, its KV usage its `kv_usage`, its requests in flight (as the policies read
//! them, below) its `in_flight`, or the prompt tokens of those (a block that several hold
//! once, as the engine holds it) its `tokens`; an overloaded
//! engine is left out of a decision while an available one is not overloaded, and takes part
//! when every one is (the policies' formulas are untouched: they choose among the engines
//! left).
//!
//! With [`LoadSource::Engine`], the requests an engine reported beyond this router's own in
//! flight at the read (`outside`: another replica's, traffic that bypassed the router) are
//! added to its counters until the next read, at this router's mean request so far: each adds
//! one request and the mean `input_length` to `ongoing_tokens`; those of them reported waiting
//! add the mean `new_prefill` to `pending_prefill_tokens`, the others the mean `input_length`
//! to `ongoing_decode_tokens` (docs/semantics.md §2).
//!
//! O(1) per read and per route, plus O(instances) for a route while any engine is overloaded
//! or, with [`LoadSource::Engine`], while any reports outside requests. Not synchronised, as
//! the [`Router`].

use super::{LoadSource, Router};
use crate::error::{Error, Result};
use crate::picker::InstanceLoad;

/// Outside requests counted per engine at most (a report beyond counts as this many).
pub const MAX_OUTSIDE: u64 = 1 << 32;

/// When an engine counts as overloaded (`None`: that signal is not used).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OverloadRule {
    /// Waiting requests (reported, plus those sent since the report) at or above which.
    pub waiting: Option<u64>,
    /// KV-cache usage (0 to 1) at or above which.
    pub kv_usage: Option<f64>,
    /// Requests in flight there as the policies read them (`num_requests`, with the outside
    /// requests under [`LoadSource::Engine`]) at or above which; needs no report.
    pub in_flight: Option<u64>,
    /// Prompt tokens in flight there (`ongoing_tokens` less the blocks that several of those
    /// requests share, counted once; with the outside requests' under
    /// [`LoadSource::Engine`]) at or above which; needs no report. Admission binds a request
    /// only where its own tokens fit under it too ([`Router::takes`]).
    pub tokens: Option<u64>,
}

/// One engine's last report, as routing reads it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineLoad {
    /// Requests running, as reported.
    pub running: u64,
    /// Requests waiting, as reported.
    pub waiting: u64,
    /// KV-cache usage, 0 to 1.
    pub kv_usage: f64,
    /// Requests this router sent the engine since the report.
    pub sent_since: u64,
    /// Requests reported (running and waiting) beyond this router's own in flight there at
    /// the report, at most [`MAX_OUTSIDE`].
    pub outside: u64,
}

/// The reports and the rule (see the module doc).
#[derive(Debug, Clone, Default)]
pub(crate) struct EngineLoads {
    /// Per instance: its last report and the requests sent it by then.
    reports: Vec<Option<(EngineLoad, u64)>>,
    /// Per instance: requests routed to it so far.
    sent: Vec<u64>,
    /// Requests routed so far, and the sums of their `input_length` and `new_prefill`.
    routed: (u64, u128, u128),
    pub rule: OverloadRule,
}

impl EngineLoads {
    pub fn new(instances: usize) -> Self {
        Self {
            reports: vec![None; instances],
            sent: vec![0; instances],
            routed: (0, 0, 0),
            rule: OverloadRule::default(),
        }
    }

    pub fn add_instance(&mut self) {
        self.reports.push(None);
        self.sent.push(0);
    }

    /// A request of `input_length` tokens, `new_prefill` of them uncached, was routed to `i`.
    pub fn sent_to(&mut self, i: usize, input_length: u64, new_prefill: u64) {
        self.sent[i] += 1;
        let (n, input, prefill) = &mut self.routed;
        *n += 1;
        *input += u128::from(input_length);
        *prefill += u128::from(new_prefill);
    }

    /// `i`'s last report, with the requests sent since.
    pub fn get(&self, i: usize) -> Option<EngineLoad> {
        let (load, at) = self.reports[i]?;
        Some(EngineLoad { sent_since: self.sent[i] - at, ..load })
    }

    /// `own` with the outside requests of every report added (see the module doc), into
    /// `seen`; false (and `seen` untouched) when no report has any.
    pub fn add_outside(&self, own: &[InstanceLoad], seen: &mut Vec<InstanceLoad>) -> bool {
        if (0..own.len()).all(|i| self.outside(i) == 0) {
            return false;
        }
        let (_, input, prefill) = self.routed;
        let share = |count: u64, sum: u128| self.mean_share(count, sum);
        seen.clear();
        seen.extend(own.iter().enumerate().map(|(i, l)| {
            let Some((report, _)) = self.reports[i] else { return l.clone() };
            let (all, waiting) = (report.outside, report.outside.min(report.waiting));
            InstanceLoad {
                num_requests: l.num_requests + all,
                ongoing_tokens: l.ongoing_tokens.saturating_add(share(all, input)),
                pending_prefill_tokens: l.pending_prefill_tokens.saturating_add(share(waiting, prefill)),
                ongoing_decode_tokens: l.ongoing_decode_tokens.saturating_add(share(all - waiting, input)),
                available: l.available,
            }
        }));
        true
    }

    /// The prompt tokens of `count` requests at this router's mean prompt so far.
    fn at_mean_input(&self, count: u64) -> u64 {
        self.mean_share(count, self.routed.1)
    }

    /// `count` requests at the mean of `sum` over the requests routed so far.
    fn mean_share(&self, count: u64, sum: u128) -> u64 {
        let n = u128::from(self.routed.0.max(1));
        u64::try_from(u128::from(count) * sum / n).unwrap_or(u64::MAX)
    }

    /// `i`'s outside requests at its last report (0 without one).
    fn outside(&self, i: usize) -> u64 {
        self.reports[i].map_or(0, |(l, _)| l.outside)
    }

    /// Whether `i`'s report makes it overloaded by the rule (never without one).
    pub fn reported_over(&self, i: usize) -> bool {
        let Some(load) = self.get(i) else { return false };
        let waiting = load.waiting + load.sent_since;
        self.rule.waiting.is_some_and(|w| waiting >= w)
            || self.rule.kv_usage.is_some_and(|k| load.kv_usage >= k)
    }
}

impl Router {
    /// `instance`'s engine reports `running` and `waiting` requests and a KV-cache usage of
    /// `kv_usage` (0 to 1) now.
    pub fn set_engine_load(
        &mut self,
        instance: i64,
        running: u64,
        waiting: u64,
        kv_usage: f64,
    ) -> Result<()> {
        let i = self.check_instance(instance)?;
        if !(0.0..=1.0).contains(&kv_usage) {
            return Err(Error::InvalidArgument(format!("kv_usage must be in [0, 1], got {kv_usage}")));
        }
        let reported = running.saturating_add(waiting);
        let outside = reported.saturating_sub(self.loads[i].num_requests).min(MAX_OUTSIDE);
        let load = EngineLoad { running, waiting, kv_usage, sent_since: 0, outside };
        self.engine.reports[i] = Some((load, self.engine.sent[i]));
        Ok(())
    }

    /// `instance`'s report is gone (its read failed or went stale): routing reads only the
    /// router's own counts for it, and it is never overloaded.
    pub fn clear_engine_load(&mut self, instance: i64) -> Result<()> {
        let i = self.check_instance(instance)?;
        self.engine.reports[i] = None;
        Ok(())
    }

    /// `instance`'s last report, with the requests sent it since.
    pub fn engine_load(&self, instance: i64) -> Result<Option<EngineLoad>> {
        Ok(self.engine.get(self.check_instance(instance)?))
    }

    /// Use `rule` from now on.
    pub fn set_overload_rule(&mut self, rule: OverloadRule) -> Result<()> {
        if rule.kv_usage.is_some_and(|k| !(0.0..=1.0).contains(&k))
            || rule.waiting == Some(0)
            || rule.in_flight == Some(0)
            || rule.tokens == Some(0)
        {
            return Err(Error::InvalidArgument(format!(
                "an overload rule needs waiting, in_flight and tokens >= 1 and kv_usage in [0, 1], got {rule:?}"
            )));
        }
        self.engine.rule = rule;
        self.held
            .track(rule.tokens.is_some() || self.policy.reads_held(&self.config.params), self.loads.len());
        Ok(())
    }

    /// The loads the policies read (see the module doc): the router's own, or, with
    /// [`LoadSource::Engine`] and some engine reporting outside requests, those with them
    /// added (in `self.seen`).
    pub(super) fn policy_loads(&mut self) -> bool {
        self.config.load_source == LoadSource::Engine && self.engine.add_outside(&self.loads, &mut self.seen)
    }

    /// The loads the policies would read now, per instance (a copy; see the module doc).
    pub fn policy_loads_now(&self) -> Vec<InstanceLoad> {
        let mut seen = Vec::new();
        match self.config.load_source == LoadSource::Engine && self.engine.add_outside(&self.loads, &mut seen)
        {
            true => seen,
            false => self.loads.clone(),
        }
    }

    /// Whether `instance` is overloaded now (see the module doc).
    pub fn is_overloaded(&self, instance: usize) -> bool {
        instance < self.loads.len() && self.overloaded(instance)
    }

    pub(super) fn overloaded(&self, i: usize) -> bool {
        let rule = &self.engine.rule;
        rule.in_flight.is_some_and(|cap| self.in_flight_on(i) >= cap)
            || rule.tokens.is_some_and(|cap| self.tokens_on(i) >= cap)
            || self.engine.reported_over(i)
    }

    /// The outside requests the caps count on instance `i` (none under
    /// [`LoadSource::Router`]).
    fn outside_on(&self, i: usize) -> u64 {
        match self.config.load_source {
            LoadSource::Engine => self.engine.outside(i),
            LoadSource::Router => 0,
        }
    }

    /// Prompt tokens in flight on instance `i` as the token cap counts them: a block that
    /// several of them hold once, as the engine holds it (the outside requests' at this
    /// router's mean request).
    fn tokens_on(&self, i: usize) -> u64 {
        let outside = self.engine.at_mean_input(self.outside_on(i));
        let shared = self.held.shared_blocks(i).saturating_mul(self.config.block_size);
        self.loads[i].ongoing_tokens.saturating_sub(shared).saturating_add(outside)
    }

    /// Requests in flight on instance `i` as the in-flight cap counts them.
    fn in_flight_on(&self, i: usize) -> u64 {
        self.loads[i].num_requests + self.outside_on(i)
    }

    /// Requests instance `i` takes now before it is overloaded: 0 when it is unavailable or
    /// overloaded; under an in-flight cap, the cap less its requests in flight; else
    /// `u64::MAX`. Admission counts the engines it holds for sessions against it.
    pub fn room_on(&self, i: usize) -> u64 {
        if !self.has_room_on(i) {
            return 0;
        }
        match self.engine.rule.in_flight {
            Some(cap) => cap.saturating_sub(self.in_flight_on(i)),
            None => u64::MAX,
        }
    }

    /// Whether instance `i` takes a request of `input_length` tokens and `keys` now, with
    /// `held` rooms and prompt tokens kept there for other sessions' next requests
    /// (admission's holds): it has more room than the rooms held ([`Router::room_on`]) and,
    /// under a token cap, its tokens in flight, the held ones and the request's stay within
    /// the cap, the request's leading blocks that a request in flight there holds already not
    /// counted (an engine with nothing in flight or held takes a request of any length).
    pub fn takes(&self, i: usize, keys: &[u64], input_length: u64, held: (u64, u64)) -> bool {
        if self.room_on(i) <= held.0 {
            return false;
        }
        let Some(cap) = self.engine.rule.tokens else { return true };
        let used = self.tokens_on(i).saturating_add(held.1);
        let shared = self.held.held_prefix(i, keys).saturating_mul(self.config.block_size);
        used == 0 || used.saturating_add(input_length.saturating_sub(shared)) <= cap
    }

    /// Whether some available instance is not overloaded: a request routed now has room
    /// (admission waits until one has).
    pub fn has_room(&self) -> bool {
        (0..self.loads.len()).any(|i| self.has_room_on(i))
    }

    /// Whether instance `i` is available and not overloaded.
    pub fn has_room_on(&self, i: usize) -> bool {
        self.loads.get(i).is_some_and(|l| l.available) && !self.overloaded(i)
    }

    /// Leave out of the next decision the available instances that are overloaded, while
    /// one available is not; the ones left out, to [`Router::restore`] after it.
    pub(super) fn hide_overloaded(&mut self) -> Vec<usize> {
        let n = self.loads.len();
        if self.engine.rule == OverloadRule::default() {
            return Vec::new();
        }
        let over: Vec<usize> = (0..n).filter(|&i| self.loads[i].available && self.overloaded(i)).collect();
        let available = self.loads.iter().filter(|l| l.available).count();
        if over.is_empty() || over.len() == available {
            return Vec::new();
        }
        for &i in &over {
            self.set_available(i as i64, false).expect("an instance of the router");
        }
        over
    }

    /// Put back what [`Router::hide_overloaded`] left out.
    pub(super) fn restore(&mut self, hidden: &[usize]) {
        for &i in hidden {
            self.set_available(i as i64, true).expect("an instance of the router");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::OverloadRule;
    use crate::{Id, LoadSource, Policy, Router, RouterConfig};

    #[test]
    fn an_overloaded_engine_is_left_out_while_another_is_not() {
        let mut r = Router::new(2, Policy::RoundRobin, RouterConfig::default()).unwrap();
        r.set_overload_rule(OverloadRule {
            waiting: Some(3),
            kv_usage: Some(0.9),
            ..OverloadRule::default()
        })
        .unwrap();
        r.set_engine_load(0, 4, 3, 0.5).unwrap(); // waiting at the threshold
        let mut picks = Vec::new();
        for n in 0..4 {
            picks.push(r.route(Id::Int(n), &[], 10, None).unwrap().instance);
        }
        assert_eq!(picks, vec![1, 1, 1, 1]);
        assert!(r.is_available(0), "hidden for the decisions only");
        // Instance 1 reports a full KV cache: both over, both take part again.
        r.set_engine_load(1, 9, 0, 0.95).unwrap();
        let both: Vec<usize> = (4..8).map(|n| r.route(Id::Int(n), &[], 10, None).unwrap().instance).collect();
        assert!(both.contains(&0) && both.contains(&1), "{both:?}");
        // Requests sent since a report count as waiting: 2 waiting + 1 sent reaches 3.
        r.set_engine_load(0, 0, 2, 0.1).unwrap();
        r.clear_engine_load(1).unwrap();
        assert!(!r.is_overloaded(0));
        let mut n = 8;
        while r.route(Id::Int(n), &[], 10, None).unwrap().instance != 0 {
            n += 1;
        }
        assert_eq!(r.engine_load(0).unwrap().unwrap().sent_since, 1);
        assert!(r.is_overloaded(0));
        assert!(r.set_engine_load(0, 0, 0, 1.5).is_err());
        assert!(r.set_overload_rule(OverloadRule { waiting: Some(0), ..OverloadRule::default() }).is_err());
        assert!(r.set_overload_rule(OverloadRule { in_flight: Some(0), ..OverloadRule::default() }).is_err());
        assert!(r.set_overload_rule(OverloadRule { tokens: Some(0), ..OverloadRule::default() }).is_err());
    }

    #[test]
    fn with_the_engine_source_outside_requests_count_until_the_next_read() {
        let config = RouterConfig { load_source: LoadSource::Engine, ..RouterConfig::default() };
        let mut r = Router::new(2, Policy::LoadOnly, config).unwrap();
        let own = Router::new(2, Policy::LoadOnly, RouterConfig::default()).unwrap();
        assert_eq!(r.route(Id::Int(0), &[], 100, None).unwrap().instance, 0);
        // Engine 1 serves 3 requests this router never sent: 1 beyond its own on 0.
        r.set_engine_load(1, 2, 1, 0.2).unwrap();
        r.set_engine_load(0, 1, 0, 0.1).unwrap();
        assert_eq!(r.engine_load(1).unwrap().unwrap().outside, 3);
        assert_eq!(r.engine_load(0).unwrap().unwrap().outside, 0);
        let seen = r.policy_loads_now();
        assert_eq!((seen[1].num_requests, seen[1].ongoing_tokens), (3, 300));
        assert_eq!((seen[1].pending_prefill_tokens, seen[1].ongoing_decode_tokens), (100, 200));
        let picks: Vec<usize> =
            (1..5).map(|n| r.route(Id::Int(n), &[], 100, None).unwrap().instance).collect();
        assert_eq!(
            picks,
            vec![0, 0, 0, 1],
            "0 fills to 4 (a tie at 3 goes first-seen) before 1 gets its 4th"
        );
        assert_eq!(r.state()[1].load.num_requests, 1, "the router's own counts stay its own");
        // A read that fails forgets them; the router's own source never reads them.
        r.clear_engine_load(1).unwrap();
        assert_eq!(r.policy_loads_now()[1].num_requests, 1);
        let mut own = own;
        own.set_engine_load(1, 50, 50, 0.5).unwrap();
        assert_eq!(own.policy_loads_now()[1].num_requests, 0);
        assert_eq!(own.route(Id::Int(0), &[], 100, None).unwrap().instance, 0);
        assert_eq!(own.route(Id::Int(1), &[], 100, None).unwrap().instance, 1);
    }

    #[test]
    fn an_in_flight_cap_needs_no_report_and_counts_outside_requests() {
        let config = RouterConfig { load_source: LoadSource::Engine, ..RouterConfig::default() };
        let mut r = Router::new(2, Policy::RoundRobin, config).unwrap();
        r.set_overload_rule(OverloadRule { in_flight: Some(2), ..OverloadRule::default() }).unwrap();
        let picks: Vec<usize> =
            (0..4).map(|n| r.route(Id::Int(n), &[], 10, None).unwrap().instance).collect();
        assert_eq!(picks, vec![0, 1, 0, 1]);
        assert!(!r.has_room() && r.is_overloaded(0) && r.is_overloaded(1));
        assert_eq!((r.room_on(0), r.instance_of(&Id::Int(1))), (0, Some(1)));
        r.finish(&Id::Int(1));
        assert!(r.has_room() && !r.is_overloaded(1));
        assert_eq!((r.room_on(1), r.instance_of(&Id::Int(1))), (1, None));
        // One request beyond the router's own reported on 1: full again.
        r.set_engine_load(1, 2, 0, 0.1).unwrap();
        assert!(!r.has_room());
        r.set_available(1, false).unwrap();
        r.finish(&Id::Int(0));
        assert!(r.has_room(), "0 has room");
        assert!(r.has_room_on(0) && !r.has_room_on(1) && !r.has_room_on(7));
        assert_eq!((r.room_on(0), r.room_on(1), r.room_on(7)), (1, 0, 0));
        let uncapped = Router::new(1, Policy::RoundRobin, RouterConfig::default()).unwrap();
        assert_eq!(uncapped.room_on(0), u64::MAX);
    }

    #[test]
    fn a_token_cap_takes_what_fits_and_anything_on_an_empty_engine() {
        let mut r = Router::new(2, Policy::RoundRobin, RouterConfig::default()).unwrap();
        r.set_overload_rule(OverloadRule { tokens: Some(1000), ..OverloadRule::default() }).unwrap();
        assert!(r.takes(0, &[], 5000, (0, 0)), "an empty engine takes any length");
        assert!(!r.takes(0, &[], 600, (0, 500)), "nor with tokens held for another session");
        assert!(!r.takes(0, &[], 10, (u64::MAX, 0)), "nor with every room held");
        assert_eq!(r.route(Id::Int(0), &[], 600, None).unwrap().instance, 0);
        assert!(
            r.takes(0, &[], 400, (0, 0)) && !r.takes(0, &[], 401, (0, 0)) && !r.takes(0, &[], 400, (0, 1))
        );
        assert!(!r.is_overloaded(0));
        assert_eq!(r.route(Id::Int(1), &[], 10, None).unwrap().instance, 1);
        assert_eq!(r.route(Id::Int(2), &[], 400, None).unwrap().instance, 0);
        assert!(r.is_overloaded(0) && !r.takes(0, &[], 1, (0, 0)) && r.takes(1, &[], 990, (0, 0)));
        r.finish(&Id::Int(0));
        assert!(!r.is_overloaded(0) && r.takes(0, &[], 600, (0, 0)));
        let free = Router::new(1, Policy::RoundRobin, RouterConfig::default()).unwrap();
        assert!(free.takes(0, &[], u64::MAX, (0, u64::MAX)), "no cap");
        // Under LoadSource::Engine an outside request counts at the router's mean prompt.
        let config = RouterConfig { load_source: LoadSource::Engine, ..RouterConfig::default() };
        let mut r = Router::new(1, Policy::RoundRobin, config).unwrap();
        r.set_overload_rule(OverloadRule { tokens: Some(1000), ..OverloadRule::default() }).unwrap();
        r.route(Id::Int(0), &[], 400, None).unwrap();
        assert!(r.takes(0, &[], 600, (0, 0)));
        r.set_engine_load(0, 2, 0, 0.1).unwrap();
        assert!(!r.takes(0, &[], 201, (0, 0)) && r.takes(0, &[], 200, (0, 0)), "400 + 400 outside");
    }

    #[test]
    fn a_token_cap_does_not_count_a_prefix_held_in_flight_again() {
        let config = RouterConfig { block_size: 100, ..RouterConfig::default() };
        let mut r = Router::new(1, Policy::RoundRobin, config).unwrap();
        r.set_overload_rule(OverloadRule { tokens: Some(1000), ..OverloadRule::default() }).unwrap();
        r.route(Id::Int(0), &[1, 2, 3, 4, 5], 550, None).unwrap();
        assert!(!r.takes(0, &[9, 2, 3, 4, 5], 500, (0, 0)), "550 + 500: only a leading block is shared");
        assert!(r.takes(0, &[1, 2, 3, 4, 9], 850, (0, 0)), "550 + 850 - 400 held");
        assert!(!r.takes(0, &[1, 2, 3, 4, 9], 851, (0, 0)));
        r.route(Id::Int(1), &[1, 2, 3, 4, 9], 840, None).unwrap();
        assert!(r.takes(0, &[1, 2, 3, 4], 410, (0, 0)) && !r.takes(0, &[1, 2, 3, 4], 411, (0, 0)), "990 in");
    }

    #[test]
    fn the_preferred_instance_counts_nothing_and_includes_overloaded_ones() {
        let mut r = Router::new(2, Policy::LeastWork, RouterConfig::default()).unwrap();
        r.set_overload_rule(OverloadRule { in_flight: Some(1), ..OverloadRule::default() }).unwrap();
        let keys = [1, 2, 3];
        assert_eq!(r.preferred(&keys, 1536, None), Some(0), "a tie, the counter at 0");
        assert_eq!(r.preferred(&keys, 1536, None), Some(0), "the tie counter did not move");
        assert_eq!(r.route(Id::Int(0), &keys, 1536, None).unwrap().instance, 0);
        assert_eq!(r.in_flight(), 1);
        // Instance 0 is full and holds the keys: preferred still (less work), routed elsewhere.
        assert_eq!(r.preferred(&[1, 2, 3, 4], 2048, None), Some(0));
        assert_eq!(r.route(Id::Int(1), &[1, 2, 3, 4], 2048, None).unwrap().instance, 1);
        r.set_available(0, false).unwrap();
        r.set_available(1, false).unwrap();
        assert_eq!(r.preferred(&keys, 1536, None), None);
    }
}
