//! The engine's scheduler and cost model, after vLLM V1's `Scheduler.schedule()`:
//!
//! 1. Running requests in admission order each get their next tokens (1 for a decode, the
//!    rest of the prompt for a prefill, capped by the step's token budget); when the pool
//!    cannot supply their blocks, the last running request is preempted (recompute: its
//!    blocks are freed and it goes back to the front of the waiting queue), repeatedly.
//! 2. Only when nothing was preempted: waiting requests are admitted in order while the
//!    budget lasts and fewer than `max_num_seqs` run. A request's cached tokens are its
//!    longest resident key prefix at admission (at least one token is always computed); its
//!    first chunk's blocks must fit or admission stops.
//! 3. The step lasts the cost model's time ([`super::params`]); its tokens come out at its end.
//!
//! When every running request is decoding and nothing can be admitted, the engine plans a
//! closed-form *run* of m identical-shape steps (step j lasts `a + s·(j-1)` as contexts grow
//! by one token per step) up to the first finish or the last step whose blocks still fit; an
//! arrival truncates it at the step in progress. O(running) per segment, O(running · log m)
//! for a run, O(keys) per admission.

use super::engine::{Engine, Segment};

impl Engine<'_> {
    /// Plan the next segment starting at `now` (engine idle).
    pub(super) fn plan(&mut self, now: f64) {
        debug_assert!(self.seg.is_none());
        loop {
            if self.running.is_empty() && self.waiting.is_empty() {
                return;
            }
            if self.prefilling_running == 0 && !self.running.is_empty() && self.try_run(now) {
                return;
            }
            if self.plan_step(now) {
                return;
            }
            // Everything running was preempted and nothing admitted: schedule again.
        }
    }

    /// Blocks `running` decodes need for `m` more steps, from the histogram of their
    /// contexts modulo the block size (`hist[r]` requests with `computed % kb == r`): a
    /// request at residue 0 needs `ceil(m / kb)` new blocks, one at residue r > 0 needs
    /// `ceil((r + m) / kb) - 1`. O(kb).
    fn run_need(hist: &[u64], m: u64) -> u64 {
        let kb = hist.len() as u64;
        hist.iter()
            .enumerate()
            .map(|(r, &n)| {
                let r = r as u64;
                n * if r == 0 { m.div_ceil(kb) } else { (r + m).div_ceil(kb) - 1 }
            })
            .sum()
    }

    /// Plan a decode-only run when it is what vLLM would do for the next steps.
    fn try_run(&mut self, now: f64) -> bool {
        let kb = self.p.kv_block_size;
        let mut hist = std::mem::take(&mut self.hist);
        hist.clear();
        hist.resize(kb as usize, 0);
        let mut m_max = u64::MAX;
        let mut ctx = 0u64;
        for &h in &self.running {
            let r = &self.slab[h as usize];
            m_max = m_max.min(r.output - r.generated);
            ctx += r.computed + 1;
            hist[(r.computed % kb) as usize] += 1;
        }
        let avail = self.kv.available();
        let need1 = Self::run_need(&hist, 1);
        let b = self.running.len() as u64;
        let mut admit = false;
        if need1 <= avail && b < self.p.max_num_seqs {
            if let Some(&head) = self.waiting.front() {
                let budget = self.p.max_num_batched_tokens.saturating_sub(b);
                admit = budget > 0
                    && self
                        .admission(head, budget)
                        .is_some_and(|(_, _, need, pin)| need + pin <= avail - need1);
            }
        }
        if need1 > avail || admit {
            self.hist = hist;
            return false;
        }
        if !self.closed_form {
            m_max = 1;
        }
        // Largest m <= m_max whose blocks fit (need is monotone in m).
        let (mut lo, mut hi) = (1u64, m_max);
        if Self::run_need(&hist, hi) <= avail {
            lo = hi;
        }
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if Self::run_need(&hist, mid) <= avail {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        self.hist = hist;
        let p = &self.p;
        let mut seg = Segment {
            start: now,
            steps: lo,
            a: p.step_overhead_s + p.decode_s_per_seq * b as f64 + p.decode_s_per_ctx_token * ctx as f64,
            s: p.decode_s_per_ctx_token * b as f64,
            run: true,
            has_prefill: false,
            batch: std::mem::take(&mut self.spare),
            end: 0.0,
        };
        seg.batch.clear();
        seg.batch.extend(self.running.iter().map(|&h| (h, 1)));
        seg.end = now + seg.offset(lo);
        self.seg = Some(seg);
        true
    }

    /// For waiting request `h` with `budget` tokens left: (hit keys, computed tokens, new
    /// blocks, blocks to pin), or None when it has nothing to compute (never). The hit
    /// entries' slots are left in `self.slots`.
    fn admission(&mut self, h: u32, budget: u64) -> Option<(usize, u64, u64, u64)> {
        let r = &self.slab[h as usize];
        let bs = self.p.block_size;
        // At least one token is computed: keys whose end reaches `target` cannot all hit.
        let max_keys = if r.target > r.input { r.keys.len() } else { ((r.input - 1) / bs) as usize };
        let look = self.kv.lookup(&r.keys[..r.keys.len().min(max_keys)], &mut self.slots);
        let computed = (look.hits as u64 * bs).min(r.input);
        let n = (r.target - computed).min(budget);
        (n > 0).then(|| {
            (look.hits, computed, self.blocks(computed + n) - self.blocks(computed), look.unpinned_blocks)
        })
    }

    /// Plan one step; returns false when nothing could be scheduled.
    fn plan_step(&mut self, now: f64) -> bool {
        let mut budget = self.p.max_num_batched_tokens;
        let mut batch = std::mem::take(&mut self.spare);
        batch.clear();
        let mut preempted = false;
        // Prompt tokens of the requests this step admits, and how many of them are admitted
        // for the first time (not again after a preemption).
        let mut admitted = 0u64;
        let mut new_requests = 0u64;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let h = self.running[i];
            let r = &self.slab[h as usize];
            let n = if r.prefilling { (r.target - r.computed).min(budget) } else { 1 };
            let need = self.blocks(r.computed + n) - self.blocks(r.computed);
            let mut scheduled = true;
            while !self.kv.alloc(need) {
                let victim = self.running.pop().expect("the request itself is running");
                self.preempt(victim);
                preempted = true;
                if victim == h {
                    scheduled = false;
                    break;
                }
            }
            if !scheduled {
                break;
            }
            self.slab[h as usize].private += need;
            batch.push((h, n));
            budget -= n;
            i += 1;
        }
        while !preempted && budget > 0 && (self.running.len() as u64) < self.p.max_num_seqs {
            let Some(&h) = self.waiting.front() else { break };
            let Some((hits, computed, need, pin)) = self.admission(h, budget) else { break };
            if need + pin > self.kv.available() {
                break;
            }
            self.waiting.pop_front();
            let r = &mut self.slab[h as usize];
            let mut held = std::mem::take(&mut r.held);
            debug_assert_eq!(self.slots.len(), hits);
            self.kv.pin(&self.slots, &mut held);
            let ok = self.kv.alloc(need);
            debug_assert!(ok);
            let r = &mut self.slab[h as usize];
            r.held = held;
            r.private = need;
            r.computed = computed;
            r.next_reg = hits;
            if r.first_sched.is_nan() {
                r.first_sched = now;
                r.cached_tokens = computed;
                new_requests += 1;
            }
            self.counters.prefix_queries += r.target;
            self.counters.prefix_hits += computed;
            admitted += r.target;
            let n = (r.target - computed).min(budget);
            self.running.push(h);
            self.prefilling_running += 1;
            batch.push((h, n));
            budget -= n;
        }
        if batch.is_empty() {
            self.spare = batch;
            return false;
        }
        let p = &self.p;
        let (mut pf, mut pairs, mut dec, mut ctx) = (0u64, 0f64, 0u64, 0u64);
        for &(h, n) in &batch {
            let r = &self.slab[h as usize];
            if r.prefilling {
                pf += n;
                pairs += n as f64 * (r.computed as f64 + n as f64 / 2.0);
            } else {
                dec += 1;
                ctx += r.computed + 1;
            }
        }
        let dt = p.step_overhead_s
            + p.prefill_s_per_token * pf as f64
            + p.prefill_s_per_pair * pairs
            + p.decode_s_per_seq * dec as f64
            + p.decode_s_per_ctx_token * ctx as f64
            + p.admit_s_per_token * admitted as f64
            + p.admit_s_per_request * new_requests as f64;
        self.seg = Some(Segment {
            start: now,
            end: now + dt,
            steps: 1,
            a: dt,
            s: 0.0,
            run: false,
            has_prefill: pf > 0,
            batch,
        });
        true
    }

    /// Cut a run short at the step in progress at `now` (an arrival joins after it).
    pub(super) fn truncate(&mut self, now: f64) {
        let Some(seg) = self.seg.as_mut() else { return };
        let k = seg.steps_done(now);
        let keep = if k >= 1 && seg.start + seg.offset(k) >= now { k } else { k + 1 };
        if keep < seg.steps {
            seg.steps = keep;
            seg.end = seg.start + seg.offset(keep);
        }
    }

    fn preempt(&mut self, h: u32) {
        let r = &mut self.slab[h as usize];
        let held = std::mem::take(&mut r.held);
        self.kv.release(&held, r.private);
        let r = &mut self.slab[h as usize];
        r.held = held;
        r.held.clear();
        if r.prefilling {
            self.prefilling_running -= 1;
        }
        r.private = 0;
        r.computed = 0;
        r.target = r.input + r.generated;
        r.prefilling = true;
        r.preemptions += 1;
        self.counters.preemptions += 1;
        self.waiting.push_front(h);
    }
}
