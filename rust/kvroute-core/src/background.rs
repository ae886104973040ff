//! The router's cache model, touched in place or handed to a worker thread.
//!
//! In place (the default) a route touches the chosen instance's keys before it returns. With
//! a [`TouchSink`] ([`CacheCell::touch_through`]) a route whose sink is idle hands that touch
//! (its keys and the walk's entries) to the sink's worker as a [`TouchJob`] and returns at
//! once; a busy sink gets none (the touch is applied in place), so other work queued there
//! is not held up. Every later read or write of the cache first waits until every touch
//! handed over has been applied, so operations happen in the same order as in place and
//! every result is identical. Handing off costs a copy of the request's keys.
//!
//! Thread-safety: the cache sits behind a mutex shared with the worker; touches come from the
//! one thread that owns the router.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::cache::{ClusterCache, PrefixWalk};
use crate::jobs::{locked, wait_until, JobQueue, Padded};

/// One route's touch of the cache model, to apply on a worker thread.
pub struct TouchJob {
    shared: Arc<Shared>,
    inst: usize,
    keys: Vec<u64>,
    walk: PrefixWalk,
}

impl TouchJob {
    /// Apply the touch. A panic leaves the cache unknown: the router's next use of it panics.
    pub fn apply(self) {
        let s = &self.shared;
        let applied =
            catch_unwind(AssertUnwindSafe(|| s.cache().touch_request(self.inst, &self.keys, &self.walk)));
        if applied.is_err() {
            s.failed.store(true, Ordering::Release);
            return;
        }
        s.done.fetch_add(1, Ordering::Release);
    }
}

/// Where a router may hand its touches: a queue that a worker thread runs, applying each
/// [`TouchJob`] in order.
pub trait TouchSink: Send + Sync {
    /// Whether the worker has nothing left to do (only then is a touch handed over).
    fn idle(&self) -> bool;

    /// Queue `touch`.
    fn submit_touch(&self, touch: TouchJob);
}

impl<J: From<TouchJob> + Send> TouchSink for JobQueue<J> {
    fn idle(&self) -> bool {
        JobQueue::idle(self)
    }

    fn submit_touch(&self, touch: TouchJob) {
        self.submit(J::from(touch));
    }
}

#[derive(Default)]
struct Shared {
    cache: Padded<Mutex<ClusterCache>>,
    submitted: Padded<AtomicU64>,
    done: Padded<AtomicU64>,
    failed: AtomicBool,
}

impl Shared {
    fn cache(&self) -> MutexGuard<'_, ClusterCache> {
        locked(&self.cache)
    }
}

/// The cache model and, optionally, where its touches may go.
pub(crate) struct CacheCell {
    shared: Arc<Shared>,
    sink: Option<Arc<dyn TouchSink>>,
}

impl CacheCell {
    pub fn new(cache: ClusterCache) -> Self {
        Self {
            shared: Arc::new(Shared { cache: Padded(Mutex::new(cache)), ..Shared::default() }),
            sink: None,
        }
    }

    /// Hand touches to `sink` when it is idle, from now on.
    pub fn touch_through(&mut self, sink: Arc<dyn TouchSink>) {
        drop(self.lock());
        self.sink = Some(sink);
    }

    /// The cache, once every touch handed over has been applied.
    ///
    /// # Panics
    /// If a touch panicked (the cache model is then unknown).
    #[inline]
    pub fn lock(&self) -> MutexGuard<'_, ClusterCache> {
        let s = &self.shared;
        wait_until(
            || s.done.load(Ordering::Acquire) >= s.submitted.load(Ordering::Relaxed),
            || s.failed.load(Ordering::Acquire),
            "a cache touch panicked on the worker thread",
        );
        s.cache()
    }

    /// Touch `keys` on `inst` (see [`ClusterCache::touch_request`]), through the sink when it
    /// is idle, else in place.
    #[inline]
    pub fn touch(&self, inst: usize, keys: &[u64], walk: &mut PrefixWalk) {
        let Some(sink) = self.sink.as_ref().filter(|s| s.idle()) else {
            self.lock().touch_request(inst, keys, walk);
            return;
        };
        let job = TouchJob {
            shared: Arc::clone(&self.shared),
            inst,
            keys: keys.to_vec(),
            walk: walk.take_entries(),
        };
        self.shared.submitted.fetch_add(1, Ordering::Release);
        sink.submit_touch(job);
    }
}

impl Clone for CacheCell {
    /// A copy of the cache as it stands, touched in place.
    fn clone(&self) -> Self {
        Self::new(self.lock().clone())
    }
}

impl std::fmt::Debug for CacheCell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CacheCell").field("through_sink", &self.sink.is_some()).finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::TouchJob;
    use crate::jobs::JobQueue;
    use crate::rng::SplitMix64;
    use crate::{Id, Policy, Router, RouterConfig};

    /// The same random requests through a router that touches in place and one that hands
    /// its touches to a worker thread: equal decisions, states and cache contents at every step.
    #[test]
    fn touches_on_a_worker_give_the_same_router() {
        let config = RouterConfig { cache_capacity_blocks: Some(20), ..RouterConfig::default() };
        let mut a = Router::new(4, Policy::Unified, config.clone()).unwrap();
        let mut b = Router::new(4, Policy::Unified, config).unwrap();
        let queue = Arc::new(JobQueue::<TouchJob>::default());
        b.touch_through(queue.clone());
        std::thread::scope(|scope| {
            scope.spawn(|| queue.run(TouchJob::apply));
            let mut rng = SplitMix64::new(11);
            for r in 0..3000i64 {
                let session = Id::Int(rng.below(30) as i64);
                let keys: Vec<u64> =
                    (0..1 + rng.below(12)).map(|j| (rng.below(4) * 100 + j) as u64).collect();
                let n = keys.len() as u64 * 512;
                let da = a.route(Id::Int(r), &keys, n, Some(&session)).unwrap();
                let db = b.route(Id::Int(r), &keys, n, Some(&session)).unwrap();
                assert_eq!(da, db);
                if r >= 8 {
                    assert!(a.finish(&Id::Int(r - 8)) && b.finish(&Id::Int(r - 8)));
                }
                assert_eq!(a.state(), b.state());
            }
            for i in 0..4 {
                assert_eq!(a.cached_keys(i).unwrap(), b.cached_keys(i).unwrap());
            }
            queue.stop();
        });
    }
}
