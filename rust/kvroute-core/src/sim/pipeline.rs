//! The cluster loop's second thread: engines settle there while the loop goes on.
//!
//! When an engine's segment ends, the loop reports its events at once ([`Engine::advance`]:
//! first tokens and finishes reach the router in time order) and hands the rest
//! ([`Engine::settle`]: the pool's work and the next segment's plan, most of an engine's cost)
//! to a worker thread, in order ([`JobQueue`]); the router hands that thread its cache-model
//! touches too when it is idle (`background.rs`). Engines are handed over only in runs where
//! requests come at least once per step ([`busy_steps`]), only when another event comes
//! before their next step can end, and only while they run at most
//! [`HAND_OVER_MAX_RUNNING`] requests; the rest settle in place.
//!
//! The loop may go on with events before the engine's next segment end is known, because
//! that end is at least one step away: every step lasts at least `step_overhead_s` (the cost
//! model's terms are non-negative), so an engine settling from time `t` cannot end a segment
//! before `t + step_overhead_s`. Events strictly before that bound cannot be affected by it;
//! at the bound, or before anything else touches that engine (a send to it, a sample), the
//! loop waits for the job and queues the segment end in the place among equal times it
//! reserved when the engine was handed over ([`EventQueue::reserve`]). So every engine sees
//! the same calls in the same order, the queue yields the same order, and results are
//! identical to settling in place.
//!
//! Memory O(engines); each hand-over and collection O(1) amortized. The engines sit behind
//! mutexes shared with the worker; only the loop's thread uses the rest.

use std::collections::VecDeque;
use std::sync::Mutex;

use super::engine::Engine;
use super::queue::EventQueue;
use super::trace::SimTrace;
use crate::jobs::{locked, JobQueue};
use crate::router::TouchJob;

/// Work for the second thread.
pub(super) enum Job {
    /// Settle engine `e` (after [`Engine::advance`]).
    Settle(u32),
    /// A route's touch of the router's cache model.
    Touch(TouchJob),
}

impl From<TouchJob> for Job {
    fn from(t: TouchJob) -> Self {
        Job::Touch(t)
    }
}

/// The second thread's queue.
pub(super) type Jobs = JobQueue<Job>;

/// The worker's side: run the jobs until the queue is stopped.
pub(super) fn work(jobs: &Jobs, engines: &[Mutex<Engine<'_>>]) {
    jobs.run(|job| match job {
        Job::Settle(e) => locked(&engines[e as usize]).settle(),
        Job::Touch(t) => t.apply(),
    });
}

/// Engines with more running requests settle in place: moving their state to the other
/// core and back costs more than the overlap saves.
pub(super) const HAND_OVER_MAX_RUNNING: usize = 8;

/// Whether requests arrive at least once per step on average over the trace's span: then
/// engines are worth settling on the second thread (other events come before a settling
/// engine's next step ends). Sparser runs hand it the router's touches only, since moving an
/// engine's state between cores would cost more than the overlap saves.
pub(super) fn busy_steps(trace: &SimTrace<'_>, step: f64) -> bool {
    let span = match (trace.timestamp.first(), trace.timestamp.last()) {
        (Some(first), Some(last)) => last - first,
        _ => 0.0,
    };
    trace.len() as f64 * step >= span
}

/// Stops the second thread's job queue when the loop returns, however it returns.
pub(super) struct StopOnDrop<'a>(pub &'a Jobs);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.stop();
    }
}

/// An engine handed over: its settle job's ticket, its place among equal times, and the
/// earliest its next segment can end.
#[derive(Debug, Clone, Copy)]
struct HandedOver {
    e: u32,
    ticket: u64,
    seq: u64,
    earliest: f64,
}

/// The loop's side: engines being settled on the worker, in hand-over order (their earliest
/// ends never decrease, since the loop hands engines over in time order).
pub(super) struct Settling<'a> {
    pub jobs: &'a Jobs,
    queue: VecDeque<HandedOver>,
    /// Per engine, the ticket of its settle job while it is out; entries of `queue` whose
    /// engine was collected out of turn no longer match and are skipped.
    out: Vec<Option<u64>>,
}

impl<'a> Settling<'a> {
    pub fn new(jobs: &'a Jobs, engines: usize) -> Self {
        Self { jobs, queue: VecDeque::new(), out: vec![None; engines] }
    }

    /// Queue engine `e`'s settle job (after [`Engine::advance`]); returns the ticket for
    /// [`Settling::handed_over`].
    pub fn submit(&mut self, e: usize) -> u64 {
        let ticket = self.jobs.submit(Job::Settle(e as u32));
        self.out[e] = Some(ticket);
        ticket
    }

    /// Record the hand-over of `e` (its job `ticket`), whose place among equal times is `seq`
    /// and whose next segment cannot end before `earliest`.
    pub fn handed_over(&mut self, e: usize, ticket: u64, seq: u64, earliest: f64) {
        self.queue.push_back(HandedOver { e: e as u32, ticket, seq, earliest });
    }

    /// Queue every settled engine's segment end that the next event could depend on: wait
    /// for engines whose earliest end is not after the earliest queued event, and collect
    /// those already settled on the way. Returns with nothing out only when `events` is empty
    /// after collecting.
    pub fn collect_due(&mut self, events: &mut EventQueue, engines: &[Mutex<Engine<'_>>]) {
        while let Some(&h) = self.queue.front() {
            if self.out[h.e as usize] != Some(h.ticket) {
                self.queue.pop_front();
                continue;
            }
            let due = events.peek_time().is_none_or(|t| t >= h.earliest);
            if !due && !self.jobs.is_done(h.ticket) {
                return;
            }
            self.queue.pop_front();
            self.collect(h, events, engines);
        }
    }

    /// Wait for engine `e` if it is out, and queue its segment end.
    pub fn collect_engine(&mut self, e: usize, events: &mut EventQueue, engines: &[Mutex<Engine<'_>>]) {
        let Some(ticket) = self.out[e] else { return };
        let h = *self
            .queue
            .iter()
            .find(|h| h.e as usize == e && h.ticket == ticket)
            .expect("an engine out is queued");
        self.collect(h, events, engines);
    }

    /// Wait for every engine out.
    pub fn collect_all(&mut self, events: &mut EventQueue, engines: &[Mutex<Engine<'_>>]) {
        while let Some(h) = self.queue.pop_front() {
            if self.out[h.e as usize] == Some(h.ticket) {
                self.collect(h, events, engines);
            }
        }
    }

    fn collect(&mut self, h: HandedOver, events: &mut EventQueue, engines: &[Mutex<Engine<'_>>]) {
        self.jobs.wait(h.ticket);
        let e = h.e as usize;
        self.out[e] = None;
        let end = locked(&engines[e]).segment_end();
        debug_assert!(end.is_none_or(|t| t >= h.earliest), "a step shorter than step_overhead_s");
        events.set_engine_in_turn(e, end, h.seq);
    }
}
