//! A FIFO of jobs for one worker thread ([`JobQueue::run`]), with a ticket per job to wait
//! on: how the simulator hands engines and router touches to its second thread
//! (`sim/pipeline.rs`).
//!
//! Both sides busy-wait (spinning, then yielding the core), because the waits are
//! microseconds long and a run that uses a second thread owns the machine's two cores. A job
//! that panics marks the queue failed and the worker goes on with the next jobs, so waiters
//! panic instead of hanging. Submit and wait O(1). Thread-safety: any thread may submit and
//! wait; one thread runs the jobs.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// Idle polls before a waiting thread starts yielding its core between polls.
const SPINS_BEFORE_YIELD: u32 = 1 << 12;

/// Waiting by polling: spin for a while, then yield the core between polls.
#[derive(Default)]
struct Backoff(u32);

impl Backoff {
    #[inline]
    fn snooze(&mut self) {
        self.0 += 1;
        if self.0 < SPINS_BEFORE_YIELD {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

/// Poll `ready` until it holds.
///
/// # Panics
/// With `what` when `failed` holds while waiting.
#[inline]
pub(crate) fn wait_until(ready: impl Fn() -> bool, failed: impl Fn() -> bool, what: &str) {
    let mut backoff = Backoff::default();
    while !ready() {
        assert!(!failed(), "{what}");
        backoff.snooze();
    }
}

/// `m`, locked. A poisoned lock (a panic on the other thread, which the job queue or the
/// cache's touch counters report to waiters) is taken as it is.
pub(crate) fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A value on cache lines of its own, so that one thread writing it does not slow down the
/// other thread's reads of its neighbours (each field below is written by one side and
/// polled or used by the other).
#[derive(Default)]
#[repr(align(128))]
pub(crate) struct Padded<T>(pub T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// Jobs for one worker thread, run in the order they were submitted.
pub struct JobQueue<J> {
    jobs: Padded<Mutex<VecDeque<J>>>,
    submitted: Padded<AtomicU64>,
    done: Padded<AtomicU64>,
    stop: AtomicBool,
    failed: AtomicBool,
}

impl<J> Default for JobQueue<J> {
    fn default() -> Self {
        Self {
            jobs: Padded(Mutex::new(VecDeque::new())),
            submitted: Padded::default(),
            done: Padded::default(),
            stop: AtomicBool::new(false),
            failed: AtomicBool::new(false),
        }
    }
}

impl<J> JobQueue<J> {
    /// Queue `job`; returns its ticket for [`JobQueue::wait`].
    pub fn submit(&self, job: J) -> u64 {
        locked(&self.jobs).push_back(job);
        self.submitted.fetch_add(1, Ordering::Release) + 1
    }

    /// Whether every job submitted so far has run.
    pub fn idle(&self) -> bool {
        self.done.load(Ordering::Acquire) == self.submitted.load(Ordering::Relaxed)
    }

    /// Whether the job with `ticket` (and every job before it) has run.
    pub fn is_done(&self, ticket: u64) -> bool {
        self.done.load(Ordering::Acquire) >= ticket
    }

    /// Wait until the job with `ticket` (and every job before it) has run; its effects are
    /// then visible to this thread.
    ///
    /// # Panics
    /// If a job panicked.
    pub fn wait(&self, ticket: u64) {
        let failed = || self.failed.load(Ordering::Acquire);
        wait_until(|| self.is_done(ticket), failed, "a worker job panicked");
        assert!(!failed(), "a worker job panicked");
    }

    /// Let [`JobQueue::run`] return once every submitted job has run.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
    }

    /// The worker's loop: `work` on each job in order until [`JobQueue::stop`]. While idle it
    /// polls the submission counter only, so the submitting thread's lock stays uncontended.
    pub fn run(&self, mut work: impl FnMut(J)) {
        let (mut taken, mut backoff) = (0u64, Backoff::default());
        loop {
            if self.submitted.load(Ordering::Acquire) == taken {
                if self.stop.load(Ordering::Acquire) {
                    return;
                }
                backoff.snooze();
                continue;
            }
            backoff = Backoff::default();
            let Some(job) = locked(&self.jobs).pop_front() else { continue };
            taken += 1;
            if catch_unwind(AssertUnwindSafe(|| work(job))).is_err() {
                self.failed.store(true, Ordering::Release);
            }
            self.done.fetch_add(1, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::JobQueue;

    /// A job that panics fails the queue's waiters; the worker keeps running later jobs.
    #[test]
    fn a_panicking_job_fails_waiters_and_the_rest_still_run() {
        let queue = JobQueue::<u32>::default();
        let ran = std::sync::atomic::AtomicU32::new(0);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                queue.run(|j| {
                    assert!(j != 1, "job 1 fails");
                    ran.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                })
            });
            queue.wait(queue.submit(0));
            queue.submit(1);
            let last = queue.submit(2);
            let waited = std::panic::catch_unwind(|| queue.wait(last));
            queue.stop();
            assert!(waited.is_err());
        });
        assert_eq!(ran.load(std::sync::atomic::Ordering::Relaxed), 2);
    }
}
