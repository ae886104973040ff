//! The core's error type. Every fallible public function returns [`Result`]; nothing panics
//! on bad input. The Python bindings map each variant to one exception class.

use std::fmt;

/// What went wrong, with enough context to name the argument at fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// A policy name that is not one of [`crate::Policy::ALL`].
    UnknownPolicy(String),
    /// An argument outside its domain; the message names it.
    InvalidArgument(String),
    /// An instance index that does not exist.
    UnknownInstance { index: i64, count: usize },
    /// `route` for a request id that is still in flight.
    DuplicateRequest(String),
    /// Every instance is removed or marked down.
    NoInstanceAvailable,
}

/// Shorthand for results of this crate.
pub type Result<T> = std::result::Result<T, Error>;

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::UnknownPolicy(name) => write!(
                f,
                "unknown policy {name:?}; known policies: {}",
                crate::Policy::ALL.map(|p| p.name()).join(", ")
            ),
            Error::InvalidArgument(msg) => f.write_str(msg),
            Error::UnknownInstance { index, count } => {
                write!(f, "unknown instance {index}: the router has instances 0..{count}")
            }
            Error::DuplicateRequest(id) => {
                write!(f, "request {id} is already in flight; finish it before routing it again")
            }
            Error::NoInstanceAvailable => f.write_str("no instance is available to route to"),
        }
    }
}

impl std::error::Error for Error {}
