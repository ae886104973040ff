//! One simulated vLLM engine: requests, the waiting and running queues, the KV pool, and
//! the segment in progress (one step, or a closed-form run of decode-only steps).
//!
//! The caller drives it by time: [`Engine::submit`] at a request's arrival,
//! [`Engine::segment_end`] for when something next happens, [`Engine::complete_segment`]
//! at that time (events out, next segment planned). Scheduling and the cost model are in
//! [`super::sched`], the commit of a finished segment in [`super::commit`], the event types
//! in [`super::events`]. Per call: O(running requests + keys admitted); memory O(requests in
//! the engine). Not synchronised: owned by one cluster loop or one Python object.

use std::borrow::Cow;
use std::collections::VecDeque;

pub use super::events::{EngineCounters, EngineEvent, EngineStats, FinishInfo, Reject};
use super::kv::{KvPool, PoolEvent};
use super::params::EngineParams;
use super::segment::KvOp;
pub(super) use super::segment::Segment;
use crate::error::Result;

#[derive(Debug, Clone)]
pub(super) struct Req<'a> {
    pub tag: u64,
    pub keys: Cow<'a, [u64]>,
    pub input: u64,
    pub output: u64,
    pub generated: u64,
    pub computed: u64,
    /// Tokens to hold in KV before the next token is sampled (while prefilling).
    pub target: u64,
    pub prefilling: bool,
    pub held: Vec<u32>,
    pub private: u64,
    pub next_reg: usize,
    pub arrival: f64,
    pub first_sched: f64,
    pub first_token: f64,
    pub cached_tokens: u64,
    pub preemptions: u32,
    pub overlap: bool,
    pub alive: bool,
}

/// One simulated engine.
#[derive(Debug, Clone)]
pub struct Engine<'a> {
    pub(super) p: EngineParams,
    pub(super) kv: KvPool,
    pub(super) slab: Vec<Req<'a>>,
    pub(super) free: Vec<u32>,
    pub(super) zombies: Vec<u32>,
    pub(super) waiting: VecDeque<u32>,
    pub(super) running: Vec<u32>,
    pub(super) prefilling_running: usize,
    pub(super) seg: Option<Segment>,
    /// The segment [`Engine::advance`] ended, until [`Engine::settle`].
    pub(super) settling: Option<Segment>,
    /// Pool operations `settle` owes (scratch between the two).
    pub(super) kv_ops: Vec<KvOp>,
    pub(super) spare: Vec<(u32, u64)>,
    pub(super) counters: EngineCounters,
    pub(super) emit_tokens: bool,
    pub(super) closed_form: bool,
    /// Scratch: entry slots of the last prefix lookup.
    pub(super) slots: Vec<u32>,
    /// Scratch: decode contexts by residue modulo the KV block size.
    pub(super) hist: Vec<u64>,
}

impl<'a> Engine<'a> {
    /// An idle engine with an empty pool. `emit_tokens`: report [`EngineEvent::Tokens`].
    pub fn new(params: EngineParams, emit_tokens: bool) -> Result<Self> {
        params.validate()?;
        Ok(Self {
            kv: KvPool::new(params.total_blocks()),
            p: params,
            slab: Vec::new(),
            free: Vec::new(),
            zombies: Vec::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            prefilling_running: 0,
            seg: None,
            settling: None,
            kv_ops: Vec::new(),
            spare: Vec::new(),
            counters: EngineCounters::default(),
            emit_tokens,
            closed_form: true,
            slots: Vec::new(),
            hist: Vec::new(),
        })
    }

    /// Whether decode-only stretches are advanced in closed form (default) or step by step
    /// (same results up to float rounding; for validation).
    pub fn set_closed_form(&mut self, on: bool) {
        self.closed_form = on;
    }

    /// The parameters in use.
    pub fn params(&self) -> &EngineParams {
        &self.p
    }

    /// Pool blocks covering `tokens`.
    pub(super) fn blocks(&self, tokens: u64) -> u64 {
        tokens.div_ceil(self.p.kv_block_size)
    }

    /// Refuse (and count) a request of these lengths that could never fit in the pool, as
    /// [`Engine::submit`] does.
    pub fn refuse_oversized(
        &mut self,
        input_length: u64,
        output_length: u64,
    ) -> std::result::Result<(), Reject> {
        let need = self.blocks(input_length.max(1) + output_length.max(1));
        if need > self.kv.total() {
            self.counters.rejected += 1;
            return Err(Reject::ExceedsKvCapacity { need_blocks: need, total_blocks: self.kv.total() });
        }
        Ok(())
    }

    /// A request arrives at `now`; returns its handle. Keys past the prompt are ignored; an
    /// output of 0 tokens counts as 1. Refused when it could never fit in the pool.
    pub fn submit(
        &mut self,
        tag: u64,
        keys: Cow<'a, [u64]>,
        input_length: u64,
        output_length: u64,
        now: f64,
    ) -> std::result::Result<u32, Reject> {
        self.refuse_oversized(input_length, output_length)?;
        let input_length = input_length.max(1);
        let output = output_length.max(1);
        let n_keys = input_length.div_ceil(self.p.block_size) as usize;
        let keys = match keys {
            Cow::Borrowed(k) => Cow::Borrowed(&k[..k.len().min(n_keys)]),
            Cow::Owned(mut k) => {
                k.truncate(n_keys);
                Cow::Owned(k)
            }
        };
        let mut req = Req {
            tag,
            keys,
            input: input_length,
            output,
            generated: 0,
            computed: 0,
            target: input_length,
            prefilling: true,
            held: Vec::new(),
            private: 0,
            next_reg: 0,
            arrival: now,
            first_sched: f64::NAN,
            first_token: f64::NAN,
            cached_tokens: 0,
            preemptions: 0,
            overlap: false,
            alive: true,
        };
        let handle = match self.free.pop() {
            Some(h) => {
                // Keep the slot's key-list allocation.
                req.held = std::mem::take(&mut self.slab[h as usize].held);
                req.held.clear();
                self.slab[h as usize] = req;
                h
            }
            None => {
                self.slab.push(req);
                (self.slab.len() - 1) as u32
            }
        };
        self.waiting.push_back(handle);
        match &self.seg {
            None => self.plan(now),
            Some(seg) if seg.run && seg.steps > 1 => self.truncate(now),
            Some(_) => {}
        }
        Ok(handle)
    }

    /// How much later than now a request arriving now reaches the scheduler: the engine's
    /// `busy_handling_s` while a step is in progress, 0 at an idle engine.
    pub fn arrival_delay(&self) -> f64 {
        if self.seg.is_some() {
            self.p.busy_handling_s
        } else {
            0.0
        }
    }

    /// When the segment in progress ends (None: idle).
    pub fn segment_end(&self) -> Option<f64> {
        self.seg.as_ref().map(|s| s.end)
    }

    /// The end of the next step after `t` (the next time a token can come out).
    pub fn next_step_end(&self, t: f64) -> Option<f64> {
        let seg = self.seg.as_ref()?;
        let k = seg.steps_done(t);
        Some(if k < seg.steps { seg.start + seg.offset(k + 1) } else { seg.end })
    }

    /// For a decode run in progress, each live request's tokens as of time `t`:
    /// `f(tag, generated, end of the last finished step)`; nothing before its first step ends.
    pub fn run_progress(&self, t: f64, mut f: impl FnMut(u64, u64, f64)) {
        let Some(seg) = self.seg.as_ref().filter(|s| s.run) else {
            return;
        };
        let k = seg.steps_done(t);
        if k == 0 {
            return;
        }
        let time = seg.start + seg.offset(k);
        for &(h, _) in &seg.batch {
            let r = &self.slab[h as usize];
            if r.alive {
                f(r.tag, r.generated + k, time);
            }
        }
    }

    /// Drop a request (client gone). Its blocks are freed at once; a step it is part of
    /// still takes its planned time. Returns whether it was in the engine.
    pub fn cancel(&mut self, handle: u32) -> bool {
        let Some(r) = self.slab.get_mut(handle as usize).filter(|r| r.alive) else {
            return false;
        };
        r.alive = false;
        let (held, private, prefilling) = (std::mem::take(&mut r.held), r.private, r.prefilling);
        if let Some(i) = self.waiting.iter().position(|&h| h == handle) {
            self.waiting.remove(i);
        } else if let Some(i) = self.running.iter().position(|&h| h == handle) {
            self.running.remove(i);
            self.kv.release(&held, private);
            if prefilling {
                self.prefilling_running -= 1;
            }
        }
        self.zombies.push(handle);
        if self.seg.is_none() {
            self.reap();
        }
        true
    }

    /// Empty the prefix cache of every entry no running request holds; the blocks emptied.
    pub fn reset_prefix_cache(&mut self) -> u64 {
        self.kv.reset()
    }

    /// Log the pool's stores, evictions and resets ([`KvPool::record_events`]).
    pub fn record_kv_events(&mut self, on: bool) {
        self.kv.record_events(on);
    }

    /// The pool's events since the last call ([`KvPool::take_events`]).
    pub fn take_kv_events(&mut self) -> Vec<PoolEvent> {
        self.kv.take_events()
    }

    /// Queues, pool use and counters (as of the last step boundary).
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            running: self.running.len(),
            waiting: self.waiting.len(),
            kv_used_blocks: self.kv.pinned(),
            kv_cached_blocks: self.kv.cached(),
            kv_total_blocks: self.kv.total(),
            counters: self.counters.clone(),
        }
    }

    /// Running and waiting requests.
    pub fn load(&self) -> (usize, usize) {
        (self.running.len(), self.waiting.len())
    }

    /// The pool (read only; tests and inspection).
    pub fn kv(&self) -> &KvPool {
        &self.kv
    }

    /// Free the slots of finished or cancelled requests once no segment refers to them.
    pub(super) fn reap(&mut self) {
        self.free.append(&mut self.zombies);
    }
}
