//! Trie nodes as path identities, so that tries over key paths need no pointers.
//!
//! A node at depth `j` of a request is the path `keys[0..=j]`. It is identified by
//! `(parent, key)`: the 64-bit hash of the parent path and the node's own key, 128 bits in
//! all; the node's own path hash is `xxh3(key, seed = parent)`. Two different nodes share an
//! identity only if two different parent paths hash alike *and* continue with the same key
//! (about `n² / 2^65` for `n` parent paths, times the chance of equal keys), so chained and
//! unchained ids are handled alike (SEMANTICS §4: a node is a key path, not a key).
//!
//! Where one identity per node of the whole trace is kept (pass 2), it is the node's own path
//! hash plus a 32-bit [`check`] of `(parent, key)`: 96 bits, the same guarantee in 12 bytes.
//!
//! [`NodeSet`] is a hash set over 128-bit identities with a cheap hasher (one half is already
//! a well-mixed hash). O(1) per step; no shared state.

use std::collections::HashSet;
use std::hash::{BuildHasherDefault, Hasher};

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Path hash of the (empty) root path.
pub const ROOT: u64 = 0x6b76_726f_7574_6521; // "kvroute!" reversed

/// Identity of a trie node: parent path hash in the high half, key in the low half.
pub type Node = u128;

/// The node that continues the path hashed `parent` with `key`.
#[inline]
pub fn node(parent: u64, key: u64) -> Node {
    (u128::from(parent) << 64) | u128::from(key)
}

/// Path hash of the node `(parent, key)`, the parent of its children.
#[inline]
pub fn path_hash(parent: u64, key: u64) -> u64 {
    xxh3_64_with_seed(&key.to_le_bytes(), parent)
}

/// A 32-bit check value of the node `(parent, key)`, independent of [`path_hash`]: with it,
/// `(path_hash, check)` is a 96-bit node identity, compact enough to keep one per node.
#[inline]
pub fn check(parent: u64, key: u64) -> u32 {
    ((parent ^ key.rotate_left(32) ^ 0x243F_6A88_85A3_08D3).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as u32
}

/// Which of `shards` (a power of two) the node with path hash `h` belongs to; uses bits
/// that [`NodeHasher`] mixes with the others, so a shard's map is still evenly filled.
#[inline]
pub fn shard_of(h: u64, shards: usize) -> usize {
    (h >> 40) as usize & (shards - 1)
}

/// Hasher for [`Node`]: mixes the two halves with one multiply.
#[derive(Default, Clone, Copy)]
pub struct NodeHasher(u64);

impl Hasher for NodeHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x100_0000_01B3);
        }
    }

    #[inline]
    fn write_u128(&mut self, n: u128) {
        let mixed = ((n >> 64) as u64 ^ (n as u64).rotate_left(29)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        self.0 = mixed ^ (mixed >> 29);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

/// A set of nodes.
pub type NodeSet = HashSet<Node, BuildHasherDefault<NodeHasher>>;
