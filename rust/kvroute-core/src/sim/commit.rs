//! Committing a finished segment: prompt chunks computed (keys cached as they fill), tokens
//! out, first tokens and finishes reported, blocks of finished requests released, and the
//! next segment planned. O(requests in the segment + keys registered); part of
//! [`Engine`]'s single-threaded state machine.

use super::engine::{Engine, EngineEvent, FinishInfo};

impl Engine<'_> {
    /// End the segment in progress: tokens out, finishes, next segment planned.
    pub fn complete_segment(&mut self, out: &mut Vec<EngineEvent>) {
        let Some(mut seg) = self.seg.take() else { return };
        let t = seg.end;
        self.counters.steps += seg.steps;
        self.counters.segments += 1;
        let mut finished = false;
        if seg.run {
            // Blocks of the run's steps, taken at once (checked when the run was planned).
            let need: u64 = seg
                .batch
                .iter()
                .filter(|&&(h, _)| self.slab[h as usize].alive)
                .map(|&(h, _)| {
                    let c = self.slab[h as usize].computed;
                    self.blocks(c + seg.steps) - self.blocks(c)
                })
                .sum();
            let ok = self.kv.alloc(need);
            debug_assert!(ok, "a run's blocks were checked when it was planned");
        }
        for &(h, n) in &seg.batch {
            if !self.slab[h as usize].alive {
                continue;
            }
            if seg.run {
                let c = self.slab[h as usize].computed;
                let need = self.blocks(c + seg.steps) - self.blocks(c);
                let r = &mut self.slab[h as usize];
                r.private += need;
                r.computed += seg.steps;
                r.generated += seg.steps;
            } else if self.slab[h as usize].prefilling {
                self.slab[h as usize].computed += n;
                self.register_keys(h);
                let r = &mut self.slab[h as usize];
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
                let r = &mut self.slab[h as usize];
                r.computed += 1;
                r.generated += 1;
                r.overlap |= seg.has_prefill;
            }
            let r = &self.slab[h as usize];
            if self.emit_tokens {
                out.push(EngineEvent::Tokens { tag: r.tag, time: t, generated: r.generated });
            }
            if r.generated >= r.output {
                self.finish(h, t, out);
                finished = true;
            }
        }
        if finished {
            let slab = &self.slab;
            self.running.retain(|&h| slab[h as usize].alive);
        }
        self.spare = std::mem::take(&mut seg.batch);
        self.reap();
        self.plan(t);
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

    fn finish(&mut self, h: u32, t: f64, out: &mut Vec<EngineEvent>) {
        let r = &mut self.slab[h as usize];
        r.alive = false;
        let mut held = std::mem::take(&mut r.held);
        self.kv.release(&held, r.private);
        held.clear();
        let r = &mut self.slab[h as usize];
        r.held = held;
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
