//! Long core work (ceilings, simulations) run off the GIL with Python kept responsive.
//!
//! The work runs on a scoped thread; the calling thread waits without the GIL and, every
//! 100 ms, takes it back to run `poll` (signal handlers, progress callbacks). When `poll`
//! fails (Ctrl-C raises KeyboardInterrupt), `stop` asks the work to end, the thread is
//! joined and the error is raised. A panic in the work becomes a RuntimeError, never a hang:
//! the done flag is set on the way out of the thread, panic or not.

use std::sync::{Condvar, Mutex};
use std::time::Duration;

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

type Done = (Mutex<bool>, Condvar);

/// Sets the done flag when dropped, so the waiter wakes up even if the work panics.
struct Finished<'a>(&'a Done);

impl Drop for Finished<'_> {
    fn drop(&mut self) {
        *self.0 .0.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.0 .1.notify_all();
    }
}

/// Wait up to `timeout` (without the GIL) for the done flag; returns it.
fn wait_done(py: Python<'_>, done: &Done, timeout: Option<Duration>) -> bool {
    py.detach(|| {
        let guard = done.0.lock().unwrap_or_else(|e| e.into_inner());
        let guard = match timeout {
            Some(t) => done.1.wait_timeout_while(guard, t, |d| !*d).unwrap_or_else(|e| e.into_inner()).0,
            None => done.1.wait_while(guard, |d| !*d).unwrap_or_else(|e| e.into_inner()),
        };
        *guard
    })
}

/// Run `work` on a scoped thread; see the module doc. `what` names the work in errors.
pub fn run_interruptible<T: Send>(
    py: Python<'_>,
    what: &str,
    mut poll: impl FnMut() -> PyResult<()>,
    stop: impl FnOnce(),
    work: impl FnOnce() -> T + Send,
) -> PyResult<T> {
    let done: Done = (Mutex::new(false), Condvar::new());
    std::thread::scope(|s| {
        let handle = s.spawn(|| {
            let _finished = Finished(&done);
            work()
        });
        let mut failed: Option<PyErr> = None;
        while !wait_done(py, &done, Some(Duration::from_millis(100))) {
            if let Err(e) = poll() {
                stop();
                wait_done(py, &done, None);
                failed = Some(e);
                break;
            }
        }
        let out = handle
            .join()
            .map_err(|_| PyRuntimeError::new_err(format!("kvroute: the {what} worker panicked")))?;
        failed.map_or(Ok(out), Err)
    })
}
