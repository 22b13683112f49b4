//! Why a client connection's responses are being dropped, told to whoever drops with them: the
//! connection watch cuts a connection whose client takes nothing of its answer for
//! `send_timeout`, and the response bodies it held (with their engine requests) go with it, on
//! the same thread, while an armed [`SendCut`] lives. A leaf, so the proxy's guards can ask
//! ([`send_timed_out`]) without importing the accept loop.
//!
//! A thread-local rather than a flag on each request: the question is asked only when a guard is
//! dropped, so a request costs nothing for it.

use std::cell::Cell;

thread_local! {
    static SEND_TIMED_OUT: Cell<bool> = const { Cell::new(false) };
}

/// Whether what is being dropped now goes because its client took nothing of its answer for
/// `send_timeout` (HTTP/1: the bodies are dropped with their connection, on its task).
pub fn send_timed_out() -> bool {
    SEND_TIMED_OUT.with(Cell::get)
}

/// Marks the drops that happen while it lives (once [`SendCut::arm`]ed) as a send timeout's.
#[derive(Default)]
pub(super) struct SendCut {
    armed: bool,
}

impl SendCut {
    pub(super) fn arm(&mut self) {
        self.armed = true;
        SEND_TIMED_OUT.with(|c| c.set(true));
    }
}

impl Drop for SendCut {
    fn drop(&mut self) {
        if self.armed {
            SEND_TIMED_OUT.with(|c| c.set(false));
        }
    }
}
