//! Committing a finished segment, in two phases. [`Engine::advance`] moves the requests on:
//! prompt chunks computed, tokens out, first tokens and finishes reported. [`Engine::settle`]
//! then does the pool's share in the same order as one pass would (a run's new blocks, keys
//! cached as their chunks fill, blocks of finished requests released) and plans the next
//! segment. The split lets a caller report the events at once and settle the engine on
//! another thread. O(requests in the segment + keys registered); part of [`Engine`]'s
//! single-threaded state machine.

use super::engine::Engine;
use super::events::{EngineEvent, FinishInfo};
use super::segment::KvOp;

impl Engine<'_> {
    /// End the segment in progress: tokens out, finishes, next segment planned.
    pub fn complete_segment(&mut self, out: &mut Vec<EngineEvent>) {
        self.advance(out);
        self.settle();
    }

    /// First phase of [`Engine::complete_segment`]: the segment's tokens and events; the pool
    /// is not touched. [`Engine::settle`] must follow before the engine is used otherwise.
    pub fn advance(&mut self, out: &mut Vec<EngineEvent>) {
        let Some(seg) = self.seg.take() else { return };
        let t = seg.end;
        self.counters.steps += seg.steps;
        self.counters.segments += 1;
        let mut ops = std::mem::take(&mut self.kv_ops);
        ops.clear();
        let mut finished = false;
        for &(h, n) in &seg.batch {
            let r = &mut self.slab[h as usize];
            if !r.alive {
                continue;
            }
            if seg.run {
                ops.push(KvOp::Grow(h));
                r.computed += seg.steps;
                r.generated += seg.steps;
            } else if r.prefilling {
                r.computed += n;
                ops.push(KvOp::Register(h));
                if r.computed < r.target {
                    continue;
                }
                r.prefilling = false;
                self.prefilling_running -= 1;
                r.generated += 1;
                if r.first_token.is_nan() {
                    r.first_token = t;
                    out.push(EngineEvent::FirstToken { tag: r.tag, time: t, cached_tokens: r.cached_tokens });
                }
            } else {
                r.computed += 1;
                r.generated += 1;
                r.overlap |= seg.has_prefill;
            }
            if self.emit_tokens {
                out.push(EngineEvent::Tokens { tag: r.tag, time: t, generated: r.generated });
            }
            if r.generated >= r.output {
                ops.push(KvOp::Release(h));
                self.finish(h, t, out);
                finished = true;
            }
        }
        if finished {
            let slab = &self.slab;
            self.running.retain(|&h| slab[h as usize].alive);
        }
        self.kv_ops = ops;
        self.settling = Some(seg);
    }

    /// Second phase of [`Engine::complete_segment`]: the pool's share of the segment
    /// [`Engine::advance`] ended, then the next segment planned. No-op without one.
    pub fn settle(&mut self) {
        let Some(mut seg) = self.settling.take() else { return };
        let ops = std::mem::take(&mut self.kv_ops);
        // A run's request grew from `computed - steps` to `computed` tokens.
        let grown = |e: &Self, h: u32| {
            let c = e.slab[h as usize].computed;
            e.blocks(c) - e.blocks(c - seg.steps)
        };
        if seg.run {
            // Blocks of the run's steps, taken at once (checked when the run was planned).
            let need: u64 =
                ops.iter().map(|op| if let KvOp::Grow(h) = *op { grown(self, h) } else { 0 }).sum();
            let ok = self.kv.alloc(need);
            debug_assert!(ok, "a run's blocks were checked when it was planned");
        }
        for &op in &ops {
            match op {
                KvOp::Grow(h) => self.slab[h as usize].private += grown(self, h),
                KvOp::Register(h) => self.register_keys(h),
                KvOp::Release(h) => {
                    let r = &mut self.slab[h as usize];
                    let mut held = std::mem::take(&mut r.held);
                    self.kv.release(&held, r.private);
                    held.clear();
                    self.slab[h as usize].held = held;
                }
            }
        }
        self.kv_ops = ops;
        self.spare = std::mem::take(&mut seg.batch);
        self.reap();
        self.plan(seg.end);
    }

    fn register_keys(&mut self, h: u32) {
        let (bs, kb) = (self.p.block_size, self.p.kv_block_size);
        let r = &mut self.slab[h as usize];
        while r.next_reg < r.keys.len() {
            if let Some(&ahead) = r.keys.get(r.next_reg + 8) {
                self.kv.prefetch(ahead);
            }
            let i = r.next_reg as u64;
            let end = ((i + 1) * bs).min(r.input);
            if end > r.computed {
                break;
            }
            let blocks = (end - i * bs).div_ceil(kb);
            if let Some(slot) = self.kv.register(r.keys[i as usize], blocks as u32) {
                r.held.push(slot);
                r.private -= blocks;
            }
            r.next_reg += 1;
        }
    }

    /// Report a finished request (its blocks are released by `settle`).
    fn finish(&mut self, h: u32, t: f64, out: &mut Vec<EngineEvent>) {
        let r = &mut self.slab[h as usize];
        r.alive = false;
        out.push(EngineEvent::Finish {
            tag: r.tag,
            time: t,
            info: FinishInfo {
                generated: r.generated,
                cached_tokens: r.cached_tokens,
                queue_wait: r.first_sched - r.arrival,
                preemptions: r.preemptions,
                overlap: r.overlap,
            },
        });
        self.counters.finished += 1;
        self.zombies.push(h);
    }
}
