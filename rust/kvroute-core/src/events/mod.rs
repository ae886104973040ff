//! The exact cache view: each engine's own KV-cache events (vLLM's `BlockStored`,
//! `BlockRemoved`, `AllBlocksCleared`), decoded and indexed by kvroute's chained block keys.
//!
//! - [`decode`]: a batch as vLLM publishes it (msgpack, both the map and the array encodings
//!   of its events), decoded with the `rmp` crate into [`EventBatch`].
//! - `index.rs`: the cluster index `key -> holders`, walked once per request as the estimate
//!   view is.
//! - `pending.rs`: the pending blocks of routed requests that no event has confirmed yet.
//! - `engine.rs`: one engine's view per data-parallel rank: the map from the engine's opaque
//!   block hashes to kvroute keys, the sequence cursor, and the view's state (complete,
//!   partial, degraded).
//! - `view.rs`: [`EventView`], the index, the ranks' views and the pending blocks together
//!   as the router uses them.
//!
//! vLLM's block hashes depend on its hash function and seed, so they are kept as opaque ids;
//! a stored block's kvroute key is derived from its parent's key and its token ids exactly as
//! [`crate::keys::block_hashes`] derives the key of the same tokens.
//!
//! Not synchronised: the router owns the view behind its lock.

pub mod decode;
mod engine;
mod index;
mod pending;
mod table;
mod view;

pub use engine::{Outcome, RankReport, ViewState};
pub use view::{Applied, EventView, ViewReport};

/// One batch of events from one data-parallel rank of one engine.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// The engine's timestamp of the batch (seconds since the epoch).
    pub ts: f64,
    /// Its events, in order.
    pub events: Vec<KvEvent>,
    /// The data-parallel rank that published it (0 when the batch names none).
    pub rank: u32,
}

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Consecutive full blocks of one sequence were stored.
    Stored(StoredBlocks),
    /// Blocks were evicted (their engine hashes).
    Removed {
        /// The engine's hashes of the removed blocks.
        hashes: Vec<u64>,
        /// Why these blocks are outside the view, if they are (see [`StoredBlocks::ignored`]).
        ignored: Option<&'static str>,
    },
    /// The engine dropped every cached block (`/reset_prefix_cache`).
    Cleared,
}

/// A `BlockStored` event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredBlocks {
    /// The engine's hashes of the blocks, in sequence order.
    pub hashes: Vec<u64>,
    /// The engine's hash of the block before the first one; `None` for a sequence's first block.
    pub parent: Option<u64>,
    /// The token ids of all the blocks, flattened (`hashes.len() * block_size` of them).
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// Why these blocks are outside the view, if they are: blocks of a LoRA adapter, with
    /// extra hash keys (multimodal inputs, a cache salt), on a medium other than the GPU, or
    /// of a KV-cache group other than the first. Requests keyed by their token ids alone
    /// cannot hit such blocks, so they are counted and not indexed.
    pub ignored: Option<&'static str>,
}

#[cfg(test)]
mod tests;
