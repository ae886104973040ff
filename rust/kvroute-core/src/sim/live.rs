//! One engine driven in real time by a caller's clock (the HTTP engine emulator):
//! `submit` at arrival, `next_event_time` for when to wake, `advance(now)` for the events
//! up to `now`, `cancel` when a client leaves.
//!
//! Events are cumulative and in time order: `FirstToken` (1 token out), `Tokens` (`generated`
//! so far; also reported step by step inside a closed-form decode run), `Finish` (after its
//! last `Tokens`). A `submit` first completes every segment that ended by its `now`, keeping
//! their events for the next `advance`, so arrivals are never applied out of order. A request
//! that arrives while a step is in progress is held for the engine's `busy_handling_s` and
//! reaches the scheduler then.
//! Cost: O(events) per call plus the engine's own. Not synchronised (the Python class holds
//! it behind a lock).

use std::borrow::Cow;
use std::collections::VecDeque;

use rustc_hash::FxHashMap;

use super::engine::{Engine, EngineEvent, EngineStats};
use super::kv::PoolEvent;
use super::params::EngineParams;
use crate::error::{Error, Result};
use crate::router::Id;

/// An event of one request, as the live engine reports it.
#[derive(Debug, Clone, PartialEq)]
pub enum LiveEvent {
    FirstToken { id: Id, time: f64, cached_tokens: u64 },
    Tokens { id: Id, time: f64, generated: u64 },
    Finish { id: Id, time: f64 },
}

/// An engine with request ids and a clock that only moves forward.
#[derive(Debug, Clone)]
pub struct LiveEngine {
    engine: Engine<'static>,
    now: f64,
    next_tag: u64,
    by_id: FxHashMap<Id, (u64, u32)>,
    by_tag: FxHashMap<u64, Id>,
    reported: FxHashMap<u64, u64>,
    pending: Vec<LiveEvent>,
    scratch: Vec<EngineEvent>,
    /// Requests in their busy-engine handling, by the time they reach the scheduler.
    held: VecDeque<Held>,
}

/// A request on its way to a busy engine's scheduler.
#[derive(Debug, Clone)]
struct Held {
    at: f64,
    tag: u64,
    keys: Vec<u64>,
    input_length: u64,
    output_length: u64,
}

/// `by_id`'s handle of a held request, until it reaches the engine.
const NOT_YET: u32 = u32::MAX;

impl LiveEngine {
    /// An idle engine.
    pub fn new(params: EngineParams) -> Result<Self> {
        Ok(Self {
            engine: Engine::new(params, true)?,
            now: 0.0,
            next_tag: 0,
            by_id: FxHashMap::default(),
            by_tag: FxHashMap::default(),
            reported: FxHashMap::default(),
            pending: Vec::new(),
            scratch: Vec::new(),
            held: VecDeque::new(),
        })
    }

    /// The engine's parameters.
    pub fn params(&self) -> &EngineParams {
        self.engine.params()
    }

    /// The latest time seen.
    pub fn now(&self) -> f64 {
        self.now
    }

    fn clock(&mut self, now: f64) -> Result<()> {
        if !now.is_finite() {
            return Err(Error::InvalidArgument(format!("now must be finite, got {now}")));
        }
        self.now = self.now.max(now);
        Ok(())
    }

    /// A request arrives at `now` (earlier times count as the latest time seen).
    pub fn submit(
        &mut self,
        id: Id,
        keys: Vec<u64>,
        input_length: u64,
        output_length: u64,
        now: f64,
    ) -> Result<()> {
        if self.by_id.contains_key(&id) {
            return Err(Error::DuplicateRequest(id.to_string()));
        }
        self.clock(now)?;
        self.catch_up(self.now);
        self.engine
            .refuse_oversized(input_length, output_length)
            .map_err(|r| Error::InvalidArgument(format!("request {id} rejected: {r}")))?;
        let tag = self.next_tag;
        self.next_tag += 1;
        let handling = self.engine.arrival_delay();
        let handle = if handling > 0.0 {
            let at = self.now + handling;
            self.held.push_back(Held { at, tag, keys, input_length, output_length });
            NOT_YET
        } else {
            self.engine
                .submit(tag, Cow::Owned(keys), input_length, output_length, self.now)
                .expect("checked to fit")
        };
        self.by_id.insert(id.clone(), (tag, handle));
        self.by_tag.insert(tag, id);
        Ok(())
    }

    /// When the next token (or finish) comes out, or a held request reaches the scheduler;
    /// None when idle. Events already due are due at the latest time seen.
    pub fn next_event_time(&self) -> Option<f64> {
        if !self.pending.is_empty() {
            return Some(self.now);
        }
        let step = self.engine.next_step_end(self.now);
        match self.held.front() {
            Some(h) => Some(step.map_or(h.at, |t| t.min(h.at))),
            None => step,
        }
    }

    /// Every event up to `now`, in time order.
    pub fn advance(&mut self, now: f64) -> Result<Vec<LiveEvent>> {
        self.clock(now)?;
        self.catch_up(self.now);
        let mut out = std::mem::take(&mut self.pending);
        let (by_tag, reported) = (&self.by_tag, &mut self.reported);
        self.engine.run_progress(self.now, |tag, generated, time| {
            let seen = reported.entry(tag).or_insert(0);
            if generated > *seen {
                *seen = generated;
                if let Some(id) = by_tag.get(&tag) {
                    out.push(LiveEvent::Tokens { id: id.clone(), time, generated });
                }
            }
        });
        Ok(out)
    }

    /// Empty the prefix cache (entries running requests hold stay); the blocks emptied.
    pub fn reset_prefix_cache(&mut self) -> u64 {
        self.engine.reset_prefix_cache()
    }

    /// Log the pool's stores, evictions and resets (for an engine publishing KV events).
    pub fn record_kv_events(&mut self, on: bool) {
        self.engine.record_kv_events(on);
    }

    /// The pool's events since the last call, oldest first.
    pub fn take_kv_events(&mut self) -> Vec<PoolEvent> {
        self.engine.take_kv_events()
    }

    /// Drop a request; returns whether it was in the engine.
    pub fn cancel(&mut self, id: &Id) -> bool {
        let Some((tag, handle)) = self.by_id.remove(id) else { return false };
        self.by_tag.remove(&tag);
        self.reported.remove(&tag);
        self.pending.retain(|e| match e {
            LiveEvent::FirstToken { id: i, .. }
            | LiveEvent::Tokens { id: i, .. }
            | LiveEvent::Finish { id: i, .. } => i != id,
        });
        if handle == NOT_YET {
            self.held.retain(|h| h.tag != tag);
            return true;
        }
        self.engine.cancel(handle)
    }

    /// Queues, pool and counters.
    pub fn stats(&self) -> EngineStats {
        self.engine.stats()
    }

    /// Requests in the engine.
    pub fn active(&self) -> usize {
        self.by_id.len()
    }

    /// Complete the segments and hand the held requests to the scheduler, in time order,
    /// up to `now`.
    fn catch_up(&mut self, now: f64) {
        while let Some(h) = self.held.front().filter(|h| h.at <= now) {
            let at = h.at;
            self.complete_until(at);
            let h = self.held.pop_front().expect("a held request");
            let handle = self
                .engine
                .submit(h.tag, Cow::Owned(h.keys), h.input_length, h.output_length, at)
                .expect("checked to fit");
            if let Some(id) = self.by_tag.get(&h.tag) {
                self.by_id.insert(id.clone(), (h.tag, handle));
            }
        }
        self.complete_until(now);
    }

    fn complete_until(&mut self, now: f64) {
        while let Some(end) = self.engine.segment_end().filter(|&e| e <= now) {
            let _ = end;
            let mut evs = std::mem::take(&mut self.scratch);
            evs.clear();
            self.engine.complete_segment(&mut evs);
            for ev in &evs {
                self.translate(ev);
            }
            self.scratch = evs;
        }
    }

    fn translate(&mut self, ev: &EngineEvent) {
        match *ev {
            EngineEvent::FirstToken { tag, time, cached_tokens } => {
                self.reported.insert(tag, 1);
                if let Some(id) = self.by_tag.get(&tag) {
                    self.pending.push(LiveEvent::FirstToken { id: id.clone(), time, cached_tokens });
                }
            }
            EngineEvent::Tokens { tag, time, generated } => {
                let seen = self.reported.entry(tag).or_insert(0);
                if generated > *seen {
                    *seen = generated;
                    if let Some(id) = self.by_tag.get(&tag) {
                        self.pending.push(LiveEvent::Tokens { id: id.clone(), time, generated });
                    }
                }
            }
            EngineEvent::Finish { tag, time, .. } => {
                self.reported.remove(&tag);
                if let Some(id) = self.by_tag.remove(&tag) {
                    self.by_id.remove(&id);
                    self.pending.push(LiveEvent::Finish { id, time });
                }
            }
        }
    }
}
