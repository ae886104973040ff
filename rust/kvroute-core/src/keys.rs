//! Block keys: prefix-chained 64-bit keys from token ids, and chaining of raw per-block ids.
//!
//! `key_i = xxh3_64_with_seed(bytes(block_i), seed = key_{i-1})` with `key_{-1} = ROOT_SEED`.
//! A block's bytes are its token ids as little-endian `u32`, so the keys are the same on every
//! platform and for every integer dtype the ids arrive in. The last block may be partial.
//! Raw ids are chained the same way over their 8 little-endian bytes.
//!
//! Complexity: O(tokens) (xxh3 runs at memory speed). Pure functions, thread-safe.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Seed of the chain, `key_{-1}`: the ASCII bytes of "kvroute!" read as a little-endian u64.
pub const ROOT_SEED: u64 = u64::from_le_bytes(*b"kvroute!");

/// A token id that does not fit the `u32` range every tokenizer uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenOutOfRange {
    /// Position of the offending token in the input.
    pub position: usize,
    /// Its value.
    pub value: i128,
}

/// Token ids that can be hashed: converted to `u32` with a range check.
pub trait TokenId: Copy {
    /// The id as `u32`, or `None` when it is negative or too large.
    fn to_u32(self) -> Option<u32>;
    /// The id as `i128`, for error messages.
    fn to_i128(self) -> i128;
}

macro_rules! token_id {
    ($($t:ty),*) => {$(
        impl TokenId for $t {
            fn to_u32(self) -> Option<u32> {
                u32::try_from(self).ok()
            }
            fn to_i128(self) -> i128 {
                i128::from(self)
            }
        }
    )*};
}

token_id!(u32, i32, i64, u64, i128);

/// Number of blocks covering `tokens` tokens: `ceil(tokens / block_size)`.
pub fn num_blocks(tokens: usize, block_size: usize) -> usize {
    tokens.div_ceil(block_size)
}

/// Tokens covered by `matched` leading blocks of a request of `input_length` tokens.
pub fn hit_tokens(matched: u64, block_size: u64, input_length: u64) -> u64 {
    matched.saturating_mul(block_size).min(input_length)
}

/// Prefix-chained keys of `tokens`, one per `block_size` tokens (the last block may be partial).
/// All tokens are range-checked first (one pass), then hashed block by block.
///
/// # Panics
/// When `block_size` is zero (callers validate it first).
pub fn block_hashes<T: TokenId>(tokens: &[T], block_size: usize) -> Result<Vec<u64>, TokenOutOfRange> {
    assert!(block_size > 0, "block_size must be positive");
    check_range(tokens)?;
    let mut buf: Vec<u32> = Vec::with_capacity(block_size);
    let mut prev = ROOT_SEED;
    Ok(tokens
        .chunks(block_size)
        .map(|block| {
            buf.clear();
            buf.extend(block.iter().map(|t| t.to_u32().unwrap_or_default()));
            prev = hash_block(&buf, prev);
            prev
        })
        .collect())
}

/// `i32` token ids: checked for negatives in one pass, then hashed in place as `u32`.
pub fn block_hashes_i32(tokens: &[i32], block_size: usize) -> Result<Vec<u64>, TokenOutOfRange> {
    // OR of all values: negative iff some value is (a branch-free pass that vectorizes).
    if tokens.iter().fold(0i32, |acc, &t| acc | t) < 0 {
        check_range(tokens)?;
    }
    // SAFETY: i32 and u32 have the same size and alignment, and every value is non-negative,
    // so each reads as the same number.
    let as_u32 = unsafe { std::slice::from_raw_parts(tokens.as_ptr().cast::<u32>(), tokens.len()) };
    Ok(block_hashes_u32(as_u32, block_size))
}

/// Keys of `u32` token ids (no check needed): the fastest path.
///
/// # Panics
/// When `block_size` is zero (callers validate it first).
pub fn block_hashes_u32(tokens: &[u32], block_size: usize) -> Vec<u64> {
    assert!(block_size > 0, "block_size must be positive");
    let mut prev = ROOT_SEED;
    tokens
        .chunks(block_size)
        .map(|block| {
            prev = hash_block(block, prev);
            prev
        })
        .collect()
}

/// The keys of the full blocks an engine holds for a request once its output is done: the
/// prompt's full blocks (the first `input_length / block_size` of `prompt_keys`), then the
/// blocks that `tail` (the prompt's ids after its last full block) and `output` (the ids it
/// generated) complete. `generated` tokens were sampled; the last of them was never fed back,
/// so only the first `input_length + generated - 1` tokens have their KV (vLLM's rule).
/// O(output).
pub fn sequence_keys(
    prompt_keys: &[u64],
    input_length: u64,
    tail: &[u32],
    output: &[u32],
    generated: u64,
    block_size: usize,
) -> Vec<u64> {
    assert!(block_size > 0, "block_size must be positive");
    let bs = block_size as u64;
    let full = prompt_keys.len().min(usize::try_from(input_length / bs).unwrap_or(usize::MAX));
    let mut keys = prompt_keys[..full].to_vec();
    if tail.len() as u64 != input_length - full as u64 * bs {
        return keys; // the tail does not fit the prompt: nothing beyond it is known
    }
    let computed = (input_length + generated.saturating_sub(1)).min(input_length + output.len() as u64);
    let more = usize::try_from(computed / bs).unwrap_or(usize::MAX).saturating_sub(full);
    let seq: Vec<u32> = tail.iter().chain(output).copied().take(more * block_size).collect();
    let mut prev = keys.last().copied().unwrap_or(ROOT_SEED);
    keys.extend(seq.chunks_exact(block_size).map(|block| {
        prev = hash_block(block, prev);
        prev
    }));
    keys
}

fn check_range<T: TokenId>(tokens: &[T]) -> Result<(), TokenOutOfRange> {
    match tokens.iter().position(|t| t.to_u32().is_none()) {
        None => Ok(()),
        Some(position) => Err(TokenOutOfRange { position, value: tokens[position].to_i128() }),
    }
}

/// XXH3 of one block's token ids as little-endian `u32` bytes, seeded with the previous key.
pub(crate) fn hash_block(block: &[u32], prev: u64) -> u64 {
    if cfg!(target_endian = "little") {
        // SAFETY: a `u32` slice is valid as bytes of four times its length; on a
        // little-endian target those bytes are exactly the little-endian encoding.
        let bytes =
            unsafe { std::slice::from_raw_parts(block.as_ptr().cast::<u8>(), std::mem::size_of_val(block)) };
        xxh3_64_with_seed(bytes, prev)
    } else {
        let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
        xxh3_64_with_seed(&bytes, prev)
    }
}

/// Chained keys from per-block ids that are not chained yet: `key_i = H(key_{i-1}, id_i)`.
pub fn chain_ids(ids: &[u64]) -> Vec<u64> {
    let mut prev = ROOT_SEED;
    ids.iter()
        .map(|id| {
            prev = xxh3_64_with_seed(&id.to_le_bytes(), prev);
            prev
        })
        .collect()
}

/// [`chain_ids`] applied to every list of a list column given as flat `values` and
/// `offsets` (Arrow layout: list `i` is `values[offsets[i]..offsets[i + 1]]`). Returns the
/// chained values in the same layout, or the index of the first list whose offsets are bad.
pub fn chain_ids_lists(values: &[u64], offsets: &[i64]) -> Result<Vec<u64>, usize> {
    let mut out = vec![0u64; values.len()];
    for (i, w) in offsets.windows(2).enumerate() {
        let (start, end) = (usize::try_from(w[0]).map_err(|_| i)?, usize::try_from(w[1]).map_err(|_| i)?);
        if start > end || end > values.len() {
            return Err(i);
        }
        let mut prev = ROOT_SEED;
        for (o, id) in out[start..end].iter_mut().zip(&values[start..end]) {
            prev = xxh3_64_with_seed(&id.to_le_bytes(), prev);
            *o = prev;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_count_and_partial_last_block() {
        let tokens: Vec<u32> = (0..1025).collect();
        let keys = block_hashes_u32(&tokens, 512);
        assert_eq!(keys.len(), 3);
        assert_eq!(block_hashes(&tokens, 512).unwrap(), keys);
        assert!(block_hashes_u32(&[], 512).is_empty());
    }

    #[test]
    fn keys_are_prefix_chained() {
        let a: Vec<u32> = (0..2048).collect();
        let mut b = a.clone();
        b[1500] = 7;
        let (ka, kb) = (block_hashes_u32(&a, 512), block_hashes_u32(&b, 512));
        assert_eq!(ka[..2], kb[..2]);
        assert_ne!(ka[2], kb[2]);
        assert_ne!(ka[3], kb[3], "a change propagates to every later key");
    }

    #[test]
    fn dtypes_agree_and_range_is_checked() {
        let u: Vec<u32> = vec![1, 2, 3, 4, 5];
        let i: Vec<i64> = u.iter().map(|&x| i64::from(x)).collect();
        let s: Vec<i32> = u.iter().map(|&x| x as i32).collect();
        assert_eq!(block_hashes(&i, 2).unwrap(), block_hashes_u32(&u, 2));
        assert_eq!(block_hashes(&s, 2).unwrap(), block_hashes_u32(&u, 2));
        assert_eq!(block_hashes_i32(&s, 2).unwrap(), block_hashes_u32(&u, 2));
        assert_eq!(block_hashes_i32(&[4, -1], 2).unwrap_err(), TokenOutOfRange { position: 1, value: -1 });
        let err = block_hashes(&[1i64, -3], 2).unwrap_err();
        assert_eq!(err, TokenOutOfRange { position: 1, value: -3 });
        assert!(block_hashes(&[1i64 << 33], 2).is_err());
    }

    #[test]
    fn pinned_values() {
        // These values are part of the public contract: changing them invalidates stored traces.
        assert_eq!(block_hashes_u32(&[1, 2, 3], 512), vec![PINNED_123]);
        assert_eq!(chain_ids(&[0, 1]), PINNED_CHAIN_01.to_vec());
    }

    const PINNED_123: u64 = 17135722013804238675;
    const PINNED_CHAIN_01: [u64; 2] = [1555794855776636713, 9155262315945842484];

    #[test]
    fn lists_chain_like_single_calls() {
        let values = [5, 6, 7, 5, 9];
        let offsets = [0, 3, 3, 5];
        let out = chain_ids_lists(&values, &offsets).unwrap();
        assert_eq!(out[..3], chain_ids(&[5, 6, 7])[..]);
        assert_eq!(out[3..], chain_ids(&[5, 9])[..]);
        assert_eq!(chain_ids_lists(&values, &[0, 6]), Err(0));
        assert_eq!(chain_ids_lists(&values, &[0, 2, 1]), Err(1));
    }

    #[test]
    fn sequence_keys_are_the_keys_of_prompt_and_output_together() {
        let ids: Vec<u32> = (0..100).collect();
        let (prompt, output) = ids.split_at(40);
        let keys = block_hashes_u32(prompt, 32);
        // 40 + 60 tokens sampled: the first 99 have their KV, three full blocks.
        let got = sequence_keys(&keys, 40, &prompt[32..], output, 60, 32);
        assert_eq!(got, block_hashes_u32(&ids[..96], 32));
        // Fewer sampled than known ids (the text was longer): the sampled count decides.
        assert_eq!(sequence_keys(&keys, 40, &prompt[32..], output, 25, 32), block_hashes_u32(&ids[..64], 32));
        // A tail that does not fit the prompt: its full blocks only.
        assert_eq!(sequence_keys(&keys, 40, &[1], output, 60, 32), keys[..1].to_vec());
        assert_eq!(sequence_keys(&[], 0, &[], &ids, 100, 32), block_hashes_u32(&ids[..96], 32));
    }

    #[test]
    fn hit_tokens_clamps_to_input() {
        assert_eq!(hit_tokens(2, 512, 1000), 1000);
        assert_eq!(hit_tokens(1, 512, 1000), 512);
        assert_eq!(hit_tokens(0, 512, 1000), 0);
    }
}
