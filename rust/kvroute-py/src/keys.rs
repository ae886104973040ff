//! Module functions: `block_hashes`, `chain_ids`, `sequence_keys`, `policies`, `prompt_ids`. Stateless,
//! thread-safe; hashing and scanning run with the GIL held (a 200k-token prompt takes well
//! under a millisecond).

use kvroute_core::keys::{self, TokenId, TokenOutOfRange};
use kvroute_core::Policy;
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;

use crate::convert::{self, IntArg, Tokens};
use crate::errors::invalid;

/// Prefix-chained 64-bit block keys of `token_ids`, one per `block_size` tokens.
#[pyfunction]
#[pyo3(signature = (token_ids, block_size = IntArg::of(512)), text_signature = "(token_ids, block_size=512)")]
pub fn block_hashes<'py>(
    token_ids: &Bound<'py, PyAny>,
    block_size: IntArg,
) -> PyResult<Bound<'py, PyArray1<u64>>> {
    let py = token_ids.py();
    let bs = block_size_arg(py, block_size)?;
    let tokens = convert::tokens(token_ids, "token_ids")?;
    let result = match &tokens {
        Tokens::U32(a) => match a.as_slice() {
            Ok(s) => Ok(keys::block_hashes_u32(s, bs)),
            Err(_) => hash_array(a, bs),
        },
        Tokens::I32(a) => match a.as_slice() {
            Ok(s) => keys::block_hashes_i32(s, bs),
            Err(_) => hash_array(a, bs),
        },
        Tokens::I64(a) => hash_array(a, bs),
        Tokens::U64(a) => hash_array(a, bs),
        Tokens::OwnedU32(v) => Ok(keys::block_hashes_u32(v, bs)),
        Tokens::Owned(v) => keys::block_hashes(v, bs),
    };
    let keys = result.map_err(|TokenOutOfRange { position, value }| {
        invalid(py, format!("token_ids[{position}] = {value} is outside the token id range 0..2**32"))
    })?;
    Ok(keys.into_pyarray(py))
}

/// A `block_size` argument: a positive integer (at most 2**32 tokens).
fn block_size_arg(py: Python<'_>, block_size: IntArg) -> PyResult<usize> {
    block_size.get(py, "block_size", 1, 1 << 32)
}

/// Hash a numpy array in place when it is contiguous, else a copy of it.
fn hash_array<T: TokenId + numpy::Element>(
    a: &PyReadonlyArray1<'_, T>,
    block_size: usize,
) -> Result<Vec<u64>, TokenOutOfRange> {
    match a.as_slice() {
        Ok(s) => keys::block_hashes(s, block_size),
        Err(_) => keys::block_hashes(&a.as_array().iter().copied().collect::<Vec<T>>(), block_size),
    }
}

/// Chain per-block ids that are not chained yet: `key_i = H(key_{i-1}, id_i)`.
#[pyfunction]
pub fn chain_ids<'py>(ids: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyArray1<u64>>> {
    let keys = convert::keys(ids, "ids")?;
    Ok(keys::chain_ids(keys.as_slice()).into_pyarray(ids.py()))
}

/// `chain_ids` over every list of a list column, given as Arrow-style flat `values`
/// (uint64) and `offsets` (int64, one more than the lists); returns the chained values.
#[pyfunction]
pub fn chain_ids_lists<'py>(
    values: &Bound<'py, PyAny>,
    offsets: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyArray1<u64>>> {
    let py = values.py();
    let values = convert::array::<u64>(values, "values", "uint64")?;
    let offsets = convert::array::<i64>(offsets, "offsets", "int64")?;
    let values_v = values.as_array();
    let offsets_v = offsets.as_array();
    let vals: std::borrow::Cow<'_, [u64]> =
        values_v.as_slice().map_or_else(|| values_v.iter().copied().collect::<Vec<_>>().into(), Into::into);
    let offs: std::borrow::Cow<'_, [i64]> =
        offsets_v.as_slice().map_or_else(|| offsets_v.iter().copied().collect::<Vec<_>>().into(), Into::into);
    let out = keys::chain_ids_lists(&vals, &offs)
        .map_err(|i| invalid(py, format!("offsets[{i}..{}] do not describe a list inside values", i + 1)))?;
    Ok(out.into_pyarray(py))
}

/// The keys of the full blocks an engine holds for a request once its output is done (vLLM's
/// rule; `kvroute_core::keys::sequence_keys`): the prompt's full blocks, then those that
/// `tail` (the prompt's ids after its last full block) and `output` (the generated ids)
/// complete, counting the KV of `input_length + generated - 1` tokens.
#[pyfunction]
pub fn sequence_keys<'py>(
    prompt_keys: &Bound<'py, PyAny>,
    input_length: &Bound<'py, PyAny>,
    tail: &Bound<'py, PyAny>,
    output: &Bound<'py, PyAny>,
    generated: &Bound<'py, PyAny>,
    block_size: IntArg,
) -> PyResult<Bound<'py, PyArray1<u64>>> {
    let py = prompt_keys.py();
    let bs = block_size_arg(py, block_size)?;
    let keys = convert::keys(prompt_keys, "prompt_keys")?;
    let n = convert::count(input_length, "input_length")?;
    let tail = convert::token_ids(tail, "tail")?;
    let output = convert::token_ids(output, "output")?;
    let generated = convert::count(generated, "generated")?;
    Ok(keys::sequence_keys(keys.as_slice(), n, &tail, &output, generated, bs).into_pyarray(py))
}

/// Names of every routing policy.
#[pyfunction]
pub fn policies() -> Vec<&'static str> {
    Policy::ALL.iter().map(|p| p.name()).collect()
}

/// The top-level `"prompt"` token ids of a JSON completions body and the byte range of their
/// array, when a scan finds them unambiguously (`kvroute_core::prompt_scan`); else None.
#[pyfunction]
pub fn prompt_ids<'py>(py: Python<'py>, body: &[u8]) -> Option<(Bound<'py, PyArray1<u32>>, usize, usize)> {
    let found = kvroute_core::prompt_scan::prompt_ids(body)?;
    Some((found.ids.into_pyarray(py), found.start, found.end))
}
