//! Samples of first tokens, from which the control plane fits the `ttft` policy's step costs
//! while the proxy serves (`docs/proxy.md`, "Predicting time to first token"): per streamed
//! request answered on its first attempt, the counters of its engine just before it was
//! routed there, its uncached and total prompt tokens, and the seconds from that decision to
//! its first byte.
//!
//! A bounded queue that keeps the newest [`CAPACITY`] samples until they are taken. One
//! short mutex hold per sample; shared by the relay's tasks and the control plane.

use std::collections::VecDeque;
use std::sync::Mutex;

use crate::jobs::locked;
use crate::picker::InstanceLoad;

/// Samples kept until taken; older ones are dropped first.
pub const CAPACITY: usize = 4096;

/// One request's first token.
#[derive(Debug, Clone, PartialEq)]
pub struct FirstToken {
    /// Its engine's counters (as the policy read them) just before the decision.
    pub load: InstanceLoad,
    /// Prompt tokens the router expected the engine to prefill.
    pub new_prefill: u64,
    /// Prompt tokens.
    pub input_length: u64,
    /// Seconds from the decision to the first byte of the answer's stream.
    pub seconds: f64,
}

/// The queue of samples (see the module doc).
#[derive(Debug, Default)]
pub struct FirstTokens(Mutex<VecDeque<FirstToken>>);

impl FirstTokens {
    /// Keep `sample`, dropping the oldest when full.
    pub fn push(&self, sample: FirstToken) {
        let mut q = locked(&self.0);
        if q.len() == CAPACITY {
            q.pop_front();
        }
        q.push_back(sample);
    }

    /// Every sample kept, oldest first; the queue is left empty.
    pub fn take(&self) -> Vec<FirstToken> {
        locked(&self.0).drain(..).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(seconds: f64) -> FirstToken {
        FirstToken { load: InstanceLoad::default(), new_prefill: 1, input_length: 2, seconds }
    }

    #[test]
    fn keeps_the_newest_and_empties_when_taken() {
        let q = FirstTokens::default();
        for i in 0..CAPACITY + 3 {
            q.push(sample(i as f64));
        }
        let got = q.take();
        assert_eq!(got.len(), CAPACITY);
        assert_eq!(got[0].seconds, 3.0);
        assert_eq!(got[CAPACITY - 1].seconds, (CAPACITY + 2) as f64);
        assert!(q.take().is_empty());
    }
}
