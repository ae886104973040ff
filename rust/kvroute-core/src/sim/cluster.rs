//! One simulation run: N engines behind one [`Router`], driven by a trace and a dispatch
//! mode, as an event loop over (time, sequence) events (`queue.rs`).
//!
//! The router sees what a proxy would: `route` when a request is sent, `first_token` when
//! its first token comes back, `finish` when it ends. Engines only change at their segment
//! ends and when a request arrives, so an engine has one pending event at a time, replaced
//! when it changes. Sessions are launched lazily from a cursor, so the queue holds
//! O(engines + sessions in flight) events. Deterministic for a config: ties in time break by
//! insertion order. With a second thread, the engines settle there, and the router's touches
//! go there when it is idle (`pipeline.rs`), with identical results. Time O(events ·
//! log(queue) + Σ keys + segments · running); memory O(requests) for the records plus the
//! engines' state.

use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::admission::{Bind, SimAdmission, Waiter, Waiting};
use super::dispatch::{check, launch_times, next_send, Mode};
use super::engine::{Engine, EngineEvent};
use super::output::{Records, RunStats, Series, SimOutput, EXCEEDS_KV, OK};
use super::params::EngineParams;
use super::pipeline::{busy_steps, work, Jobs, Settling, StopOnDrop, HAND_OVER_MAX_RUNNING};
use super::queue::{EventQueue, Kind, Next};

/// The most instance samples (samples x instances) a run takes (`sample_interval`): a bound
/// on its time and memory (about 0.5 GB of series).
pub const MAX_SAMPLES: u64 = 10_000_000;
use super::trace::{Sessions, SimTrace};
use crate::error::{Error, Result};
use crate::jobs::locked;
use crate::policy::{Policy, PolicyParams};
use crate::router::{Id, Router, RouterConfig};

/// How big the router's cache model is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouterCache {
    /// No bound.
    Unbounded,
    /// As many keys as one engine's KV pool holds (the default).
    MatchEngine,
    /// This many keys per instance.
    Blocks(usize),
}

/// One run's settings.
#[derive(Debug, Clone)]
pub struct RunConfig {
    pub instances: usize,
    pub policy: Policy,
    pub params: PolicyParams,
    pub mode: Mode,
    /// Seeds the Poisson arrivals and the router's RNG.
    pub seed: u64,
    pub engine: EngineParams,
    pub router_cache: RouterCache,
    /// Seconds between time-series samples; 0 = none.
    pub sample_interval: f64,
    /// Advance decode-only stretches in closed form (true) or step by step (validation).
    pub closed_form: bool,
    /// Settle engines, and touch the router's cache model when it is idle, on a second thread
    /// (`pipeline.rs`): same results, faster when a core is free.
    pub second_thread: bool,
    /// Admission at the router (`admission.rs`); None: every request is routed on arrival.
    pub admission: Option<SimAdmission>,
}

struct Loop<'a, 't> {
    trace: &'a SimTrace<'t>,
    sessions: &'a Sessions,
    mode: Mode,
    router: Router,
    engines: &'a [Mutex<Engine<'t>>],
    /// Engines out on the second thread, if there is one.
    settling: Option<Settling<'a>>,
    /// Every step lasts at least this long (an engine's lookahead on the second thread).
    min_step: f64,
    queue: EventQueue,
    pos: Vec<u32>,
    rec: Records,
    series: Series,
    stats: RunStats,
    in_flight: u64,
    events: Vec<EngineEvent>,
    admission: Option<SimAdmission>,
    waiting: Waiting,
    /// When the queue is next looked at for its holds ([`Kind::Admit`]).
    wake_at: f64,
}

/// Run one simulation. `cancel` is polled every few thousand events; a cancelled run
/// returns `Ok(None)`.
pub fn run(
    trace: &SimTrace<'_>,
    sessions: &Sessions,
    cfg: &RunConfig,
    cancel: &AtomicBool,
) -> Result<Option<SimOutput>> {
    let started = Instant::now();
    trace.validate()?;
    check(cfg.mode, trace)?;
    if cfg.instances == 0 {
        return Err(Error::InvalidArgument("instances must be positive".into()));
    }
    if !(cfg.sample_interval >= 0.0 && cfg.sample_interval.is_finite()) {
        return Err(Error::InvalidArgument(format!(
            "sample_interval must be >= 0, got {}",
            cfg.sample_interval
        )));
    }
    let mut ep = cfg.engine.clone();
    ep.block_size = trace.block_size;
    let mut engine = Engine::new(ep.clone(), false)?;
    engine.set_closed_form(cfg.closed_form);
    let cache = match cfg.router_cache {
        RouterCache::Unbounded => None,
        RouterCache::MatchEngine => Some(((ep.capacity_tokens() / trace.block_size) as usize).max(1)),
        RouterCache::Blocks(n) => Some(n),
    };
    let mut router = Router::new(
        cfg.instances,
        cfg.policy,
        RouterConfig {
            block_size: trace.block_size,
            cache_capacity_blocks: cache,
            cache_rule: crate::CacheRule::Trace,
            max_sessions: None,
            seed: cfg.seed,
            params: PolicyParams {
                // `ttft` predicts with the simulated engine's own costs unless given others.
                ttft_costs: cfg.params.ttft_costs.clone().or_else(|| Some(ep.ttft_costs())),
                ..cfg.params.clone()
            },
            ..RouterConfig::default()
        },
    )?;
    if let Some(a) = &cfg.admission {
        a.apply(&mut router)?;
    }
    let engines: Vec<Mutex<Engine<'_>>> = (0..cfg.instances).map(|_| Mutex::new(engine.clone())).collect();
    let jobs = cfg.second_thread.then(|| Arc::new(Jobs::default()));
    if let Some(jobs) = &jobs {
        router.touch_through(jobs.clone());
    }
    let mut lp = Loop {
        trace,
        sessions,
        mode: cfg.mode,
        router,
        engines: &engines,
        settling: jobs
            .as_deref()
            .filter(|_| busy_steps(trace, ep.step_overhead_s))
            .map(|jobs| Settling::new(jobs, cfg.instances)),
        min_step: ep.step_overhead_s,
        queue: EventQueue::new(cfg.instances),
        pos: vec![0; sessions.len()],
        rec: Records::new(trace.len()),
        series: Series::default(),
        stats: RunStats { kv_total_blocks: ep.total_blocks(), ..RunStats::default() },
        in_flight: 0,
        events: Vec::new(),
        admission: cfg.admission,
        waiting: Waiting::default(),
        wake_at: f64::INFINITY,
    };
    let finished = match jobs.as_deref() {
        None => lp.drive(cfg, cancel)?,
        Some(jobs) => std::thread::scope(|scope| {
            scope.spawn(|| work(jobs, &engines));
            let _stop = StopOnDrop(jobs);
            lp.drive(cfg, cancel)
        })?,
    };
    if !finished {
        return Ok(None);
    }
    let mut st = lp.stats;
    for e in &engines {
        let e = locked(e);
        let c = &e.stats().counters;
        st.engine_steps += c.steps;
        st.segments += c.segments;
        st.preemptions += c.preemptions;
        st.evictions += e.kv().evictions();
    }
    st.router_in_flight = lp.router.in_flight() as u64;
    st.router_counters_sum = lp
        .router
        .state()
        .iter()
        .map(|s| {
            s.load.num_requests
                + s.load.ongoing_tokens
                + s.load.pending_prefill_tokens
                + s.load.ongoing_decode_tokens
        })
        .sum();
    st.wall_s = started.elapsed().as_secs_f64();
    Ok(Some(SimOutput { records: lp.rec, series: lp.series, stats: st }))
}

impl Loop<'_, '_> {
    /// Take events until none is left; false when cancelled.
    fn drive(&mut self, cfg: &RunConfig, cancel: &AtomicBool) -> Result<bool> {
        let launches = launch_times(cfg.mode, self.trace, self.sessions, cfg.seed);
        let mut cursor = 0usize;
        if let Some(&t) = launches.first() {
            self.queue.push(t, Kind::Launch);
        }
        if cfg.sample_interval > 0.0 {
            self.queue.push(0.0, Kind::Sample);
        }
        let mut samples = 0u64;
        loop {
            if let Some(s) = &mut self.settling {
                s.collect_due(&mut self.queue, self.engines);
            }
            let Some(next) = self.queue.pop() else { return Ok(true) };
            self.stats.events += 1;
            if self.stats.events % 4096 == 0 && cancel.load(Ordering::Relaxed) {
                return Ok(false);
            }
            match next {
                Next::Driver(t, Kind::Launch) => {
                    let s = self.sessions.launch[cursor];
                    cursor += 1;
                    if let Some(&at) = launches.get(cursor) {
                        self.queue.push(at, Kind::Launch);
                    }
                    self.send(s, t)?;
                }
                Next::Driver(t, Kind::Send(s)) => self.send(s, t)?,
                Next::Driver(t, Kind::Deliver(row)) => self.deliver(row, t),
                Next::Driver(t, Kind::Admit) => self.admit(t)?,
                Next::Segment(t, e) => {
                    self.segment(e as usize, t);
                    self.admit(t)?;
                }
                Next::Driver(t, Kind::Sample) => {
                    if let Some(s) = &mut self.settling {
                        s.collect_all(&mut self.queue, self.engines);
                    }
                    self.sample(t);
                    samples += 1;
                    if samples * cfg.instances as u64 > MAX_SAMPLES {
                        return Err(Error::InvalidArgument(format!(
                            "sample_interval {:.3e} s takes more than {MAX_SAMPLES} instance samples in \
                             this run; use a larger one (or 0: none)",
                            cfg.sample_interval
                        )));
                    }
                    if !self.queue.is_empty() {
                        self.queue.push(samples as f64 * cfg.sample_interval, Kind::Sample);
                    }
                }
            }
        }
    }

    /// Session `s`'s next turn arrives at the router at `t`: routed at once (to the engine
    /// holding a room for it, if any), or with admission queued until [`Loop::admit`] lets it
    /// go.
    fn send(&mut self, s: u32, t: f64) -> Result<()> {
        let row = self.sessions.rows_of(s)[self.pos[s as usize] as usize];
        let Some(a) = self.admission else {
            return self.dispatch(row, s, t, t, Bind::Any(Vec::new()));
        };
        let (keys, input) = (self.trace.keys_of(row as usize), self.trace.input_length[row as usize] as u64);
        let held = self.waiting.take_hold(s, t);
        if let Some(x) =
            held.filter(|&x| self.router.takes(x, keys, input, self.waiting.held_on(&a, x, s, t)))
        {
            return self.dispatch(row, s, t, t, Bind::On(x));
        }
        self.waiting.push(Waiter { row, session: s, since: t });
        self.admit(t)
    }

    /// Route every waiting request that admission lets go at `t` (at each arrival and each
    /// engine step's end: while a request waits, the engine it waits for is running).
    fn admit(&mut self, t: f64) -> Result<()> {
        let Some(a) = self.admission else { return Ok(()) };
        while let Some((w, bind)) = self.waiting.next(&mut self.router, self.trace, t, &a) {
            self.dispatch(w.row, w.session, w.since, t, bind)?;
        }
        if let Some(at) = self.waiting.next_change(&a, t) {
            if at < self.wake_at || self.wake_at <= t {
                self.wake_at = at;
                self.queue.push(at, Kind::Admit);
            }
        }
        self.stats.max_waiting = self.stats.max_waiting.max(self.waiting.len() as u64);
        Ok(())
    }

    /// Route trace row `row` of session `s`, which arrived at `arrived`, at `t` (as `bind`
    /// says), and submit it to its engine.
    fn dispatch(&mut self, row: u32, s: u32, arrived: f64, t: f64, bind: Bind) -> Result<()> {
        let i = row as usize;
        let keys = self.trace.keys_of(i);
        let input = self.trace.input_length[i] as u64;
        let (rid, session) = (Id::Int(i64::from(row)), Id::Int(i64::from(s)));
        let d = match bind {
            Bind::On(x) => self.router.route_on(x, rid, keys, input, Some(&session))?,
            Bind::Any(held) => self.router.route_excluding(&held, rid, keys, input, Some(&session))?,
        };
        self.rec.router_wait[i] = t - arrived;
        self.rec.instance[i] = d.instance as i32;
        self.rec.send[i] = arrived;
        self.rec.estimated_hit_tokens[i] = d.hit_tokens as i64;
        self.in_flight += 1;
        self.stats.max_in_flight = self.stats.max_in_flight.max(self.in_flight);
        let e = d.instance;
        if let Some(s) = &mut self.settling {
            s.collect_engine(e, &mut self.queue, self.engines);
        }
        let handling = locked(&self.engines[e]).arrival_delay();
        if handling > 0.0 {
            self.queue.push(t + handling, Kind::Deliver(row));
            return Ok(());
        }
        self.deliver(row, t);
        Ok(())
    }

    /// Trace row `row`, routed already, reaches its engine's scheduler at `t`.
    fn deliver(&mut self, row: u32, t: f64) {
        let i = row as usize;
        let e = self.rec.instance[i] as usize;
        let (keys, input, output) =
            (self.trace.keys_of(i), self.trace.input_length[i] as u64, self.trace.output_length[i] as u64);
        if let Some(s) = &mut self.settling {
            s.collect_engine(e, &mut self.queue, self.engines);
        }
        let mut engine = locked(&self.engines[e]);
        let before = engine.segment_end();
        let submitted = engine.submit(u64::from(row), Cow::Borrowed(keys), input, output, t);
        let after = engine.segment_end();
        drop(engine);
        match submitted {
            Ok(_) if after != before => self.queue.set_engine(e, after),
            Ok(_) => {}
            Err(_) => {
                self.rec.error[i] = EXCEEDS_KV;
                self.rec.finish[i] = t;
                self.stats.rejected += 1;
                self.router.finish(&Id::Int(i64::from(row)));
                self.turn_done(row, t);
            }
        }
    }

    /// Engine `e`'s segment ended at `t`: report its events, settle it (on the second thread
    /// when other events come before its next segment can end, else here) and queue its next
    /// segment end.
    fn segment(&mut self, e: usize, t: f64) {
        let mut events = std::mem::take(&mut self.events);
        events.clear();
        let earliest = t + self.min_step;
        let mut engine = locked(&self.engines[e]);
        let hand_over = self.settling.is_some() && engine.load().0 <= HAND_OVER_MAX_RUNNING && {
            // Whether anything but this segment end comes first (a handed-over engine is out
            // of the queue until collected).
            self.queue.set_engine(e, None);
            self.queue.peek_time().is_some_and(|next| next < earliest)
        };
        engine.advance(&mut events);
        // What the client sees comes the request's overhead after the engine made it.
        let late = engine.params().request_overhead_s;
        // Either the settle job's ticket, or the next segment end once settled here.
        let settled = match &mut self.settling {
            Some(s) if hand_over => {
                self.stats.second_thread_settles += 1;
                Err(s.submit(e))
            }
            _ => {
                engine.settle();
                Ok(engine.segment_end())
            }
        };
        drop(engine);
        for ev in &events {
            match *ev {
                EngineEvent::FirstToken { tag, time, .. } => {
                    self.rec.first_token[tag as usize] = time + late;
                    self.router.first_token(&Id::Int(tag as i64));
                }
                EngineEvent::Finish { tag, time, info } => {
                    let (i, time) = (tag as usize, time + late);
                    self.rec.finish[i] = time;
                    self.rec.output_length[i] = info.generated as i64;
                    self.rec.cached_tokens[i] = info.cached_tokens as i64;
                    self.rec.queue_wait[i] = info.queue_wait;
                    self.rec.preemptions[i] = info.preemptions as i32;
                    self.rec.decode_overlaps_prefill[i] = info.overlap;
                    self.rec.error[i] = OK;
                    self.stats.finished += 1;
                    self.router.finish(&Id::Int(tag as i64));
                    if let Some(a) = &self.admission {
                        let (s, x) = (self.trace.session[i], self.rec.instance[i] as usize);
                        self.waiting.hold(a, s, x, self.trace.input_length[i] as u64, time);
                    }
                    self.turn_done(tag as u32, time);
                }
                EngineEvent::Tokens { .. } => {}
            }
        }
        self.events = events;
        match (settled, &mut self.settling) {
            (Ok(end), _) => self.queue.set_engine(e, end),
            (Err(ticket), Some(s)) => {
                let seq = self.queue.reserve();
                s.handed_over(e, ticket, seq, earliest);
            }
            (Err(_), None) => unreachable!("a settle job without a second thread"),
        }
    }

    /// A turn ended at `t`: send the session's next one per the dispatch mode.
    fn turn_done(&mut self, row: u32, t: f64) {
        self.in_flight -= 1;
        self.stats.makespan = self.stats.makespan.max(t);
        let s = self.trace.session[row as usize];
        let p = &mut self.pos[s as usize];
        *p += 1;
        if let Some(&next) = self.sessions.rows_of(s).get(*p as usize) {
            let at = next_send(self.mode, self.trace, self.sessions, next, t);
            self.queue.push(at, Kind::Send(s));
        }
    }

    fn sample(&mut self, t: f64) {
        for (i, e) in self.engines.iter().enumerate() {
            let e = locked(e);
            let (running, waiting) = e.load();
            let kv = e.kv();
            let s = &mut self.series;
            s.time.push(t);
            s.instance.push(i as i32);
            s.running.push(running as i32);
            s.waiting.push(waiting as i32);
            s.kv_used_blocks.push(kv.pinned() as i64);
            s.kv_cached_blocks.push(kv.cached() as i64);
        }
    }
}
