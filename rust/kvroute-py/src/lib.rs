//! `kvroute._core`: the PyO3 bindings of kvroute-core. One small file per exposed piece:
//! [`router`] (the `Router` class), `relay` (the proxy's data path, on hyper), [`keys`] (key functions), [`convert`] (argument
//! conversion), [`ceilings`] (trace ceilings over Arrow input), [`sim`] (the simulator and
//! `EngineModel`), [`text`] (a model's tokenizer and chat template), [`worker`] (interruptible
//! long work)
//! and [`errors`] (exception mapping).

mod ceilings;
mod convert;
mod errors;
mod keys;
mod kv_events;
#[cfg(unix)]
mod relay;
mod router;
mod sim;
mod text;
mod worker;

use pyo3::prelude::*;

#[pymodule(gil_used = false)]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<router::PyRouter>()?;
    m.add_class::<text::PyTextModel>()?;
    m.add_function(wrap_pyfunction!(keys::block_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(keys::chain_ids, m)?)?;
    m.add_function(wrap_pyfunction!(keys::chain_ids_lists, m)?)?;
    m.add_function(wrap_pyfunction!(keys::policies, m)?)?;
    m.add_function(wrap_pyfunction!(keys::sequence_keys, m)?)?;
    m.add_function(wrap_pyfunction!(keys::prompt_ids, m)?)?;
    m.add_function(wrap_pyfunction!(ceilings::ceilings, m)?)?;
    m.add_function(wrap_pyfunction!(kv_events::decode_kv_events, m)?)?;
    #[cfg(unix)]
    m.add_class::<relay::PyRelay>()?;
    #[cfg(unix)]
    m.add_function(wrap_pyfunction!(relay::relay_token_prompt, m)?)?;
    #[cfg(unix)]
    m.add_function(wrap_pyfunction!(relay::relay_text_prompt, m)?)?;
    m.add_function(wrap_pyfunction!(relay::relay_answer_output, m)?)?;
    m.add_class::<sim::engine_model::PyEngineModel>()?;
    m.add_function(wrap_pyfunction!(sim::simulate_runs, m)?)?;
    m.add_function(wrap_pyfunction!(sim::engine_params, m)?)?;
    m.add_function(wrap_pyfunction!(sim::engine_presets, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("BUILD_PROFILE", if cfg!(debug_assertions) { "debug" } else { "release" })?;
    m.add("ROOT_SEED", kvroute_core::keys::ROOT_SEED)?;
    m.add("MAX_INSTANCES", kvroute_core::router::MAX_INSTANCES)?;
    Ok(())
}
