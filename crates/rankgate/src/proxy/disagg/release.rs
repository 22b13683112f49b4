//! The blocks a vLLM prefill server lent for a request whose client left before its decode leg
//! was sent: released by a decode of one token sent for them in the background.
//!
//! vLLM has no API that frees a finished prefill's blocks: its prefill server frees them when a
//! decode has read them (NIXL's notification), when a decode request that carried them ends
//! before it was scheduled (its `request_finished` then notifies the prefill with no blocks
//! read), or when its lease runs out (`VLLM_NIXL_ABORT_REQUEST_TIMEOUT`, 480 s by default;
//! `kv_lease_duration` in later versions). A prefill request cannot be aborted once it has
//! answered. So a client that leaves after the prefill answered and before its decode leg went
//! out would leave the blocks pinned for the lease; rankgate finishes reading the prefill's
//! answer and sends its parameters to a decode rank with `max_tokens = 1`, which reads (and so
//! frees) them. A client that leaves during the decode leg needs none of this: its connection
//! closes, and vLLM aborts the decode, which frees the prefill's blocks either way.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::Request;
use http_body_util::BodyExt;

use super::body;
use crate::policy::Avoid;
use crate::proxy::body::ProxyBody;
use crate::proxy::error::ProxyError;
use crate::proxy::layer::Below;
use crate::proxy::shared::Ctx;
use crate::proxy::target::RetryUntil;
use crate::upstream::RequestBody;

/// A prefill server's answer is one small JSON object: more than this is no prefill answer.
pub(super) const MAX_PREFILL_ANSWER: usize = 1 << 20;

/// A prefill answer being read, and what a release of its blocks needs should the request be
/// dropped before [`Lent::handed_on`].
pub(super) struct Lent<S: Below<RequestBody> + Clone + Send + 'static> {
    /// The answer's body while unread; the bytes read so far.
    body: Option<ProxyBody>,
    read: BytesMut,
    /// The parameters, once read.
    params: Option<Bytes>,
    /// `None` once handed on (or when nothing is to be released).
    release: Option<Release<S>>,
}

/// What sending the release needs: the stack below, the request's head and body, the decode
/// ranks it may go to, and how long reading the answer and the decode may take.
pub(super) struct Release<S> {
    pub inner: S,
    pub ctx: Ctx,
    pub method: http::Method,
    pub uri: http::Uri,
    pub headers: http::HeaderMap,
    pub client: Bytes,
    pub avoid: Avoid,
    pub within: Duration,
    /// The prefill server's lease: a release after it is pointless.
    pub lease: Duration,
    /// The prefill server, whose parameters are checked before a decode sees them.
    pub engine: std::sync::Arc<crate::worker::EngineEntry>,
}

impl<S: Below<RequestBody> + Clone + Send + 'static> Lent<S> {
    pub fn new(body: ProxyBody, release: Release<S>) -> Lent<S> {
        Lent {
            body: Some(body),
            read: BytesMut::new(),
            params: None,
            release: Some(release),
        }
    }

    /// The answer, whole, within `within`; the bytes stay here until read whole, so a release
    /// can go on reading where a dropped request stopped.
    pub async fn answer(&mut self, within: Duration) -> Result<Bytes, ProxyError> {
        match tokio::time::timeout(within, read_on(&mut self.body, &mut self.read)).await {
            Err(_) => Err(ProxyError::PrefillAnswer(format!(
                "not read whole within {} ms",
                within.as_millis()
            ))),
            Ok(r) => r,
        }
    }

    /// The parameters a release would send.
    pub fn read(&mut self, params: Bytes) {
        self.params = Some(params);
    }

    /// The decode leg goes out, or nothing is lent that a decode could read: no release.
    pub fn handed_on(&mut self) {
        self.release = None;
    }
}

impl<S: Below<RequestBody> + Clone + Send + 'static> Drop for Lent<S> {
    fn drop(&mut self) {
        let Some(r) = self.release.take() else {
            return;
        };
        // Dropped off any runtime (never on the request path): nothing to send it with.
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (body, read, params) = (
            self.body.take(),
            std::mem::take(&mut self.read),
            self.params.take(),
        );
        rt.spawn(async move {
            let lease = r.lease;
            let ctx = r.ctx.clone();
            match tokio::time::timeout(lease, release(r, body, read, params)).await {
                Ok(Ok(())) => ctx.metrics.pd.released(true),
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "the blocks of an abandoned request were not released");
                    ctx.metrics.pd.released(false);
                }
                Err(_) => ctx.metrics.pd.released(false),
            }
        });
    }
}

/// Reads `body` on to its end into `read`, bounded by [`MAX_PREFILL_ANSWER`].
async fn read_on(body: &mut Option<ProxyBody>, read: &mut BytesMut) -> Result<Bytes, ProxyError> {
    if let Some(b) = body {
        while let Some(frame) = b.frame().await {
            let frame =
                frame.map_err(|e| ProxyError::PrefillAnswer(crate::http::error_chain(&*e)))?;
            if let Ok(data) = frame.into_data() {
                if read.len() + data.len() > MAX_PREFILL_ANSWER {
                    return Err(ProxyError::PrefillAnswer(format!(
                        "longer than {MAX_PREFILL_ANSWER} bytes"
                    )));
                }
                read.extend_from_slice(&data);
            }
        }
        *body = None;
    }
    Ok(read.clone().freeze())
}

/// Reads the rest of the prefill's answer (unless read already), and sends its parameters to a
/// decode rank for one token, reading that answer to its end.
async fn release<S: Below<RequestBody> + Clone + Send + 'static>(
    r: Release<S>,
    mut body: Option<ProxyBody>,
    mut read: BytesMut,
    params: Option<Bytes>,
) -> Result<(), ProxyError> {
    let params = match params {
        Some(p) => p,
        None => {
            let answer = tokio::time::timeout(r.within, read_on(&mut body, &mut read))
                .await
                .map_err(|_| ProxyError::PrefillAnswer("not read whole in time".into()))??;
            // Untrusted, as on the request's own way (`super::kv_params`).
            let raw = Bytes::copy_from_slice(body::params(&answer)?);
            super::kv_params::checked(Ok(raw), &r.engine).await?
        }
    };
    let leg = body::release(&r.client, &params)?;
    let mut req = Request::new(RequestBody::Full(Bytes::new()));
    *req.method_mut() = r.method;
    *req.uri_mut() = r.uri;
    *req.headers_mut() = r.headers;
    (req.headers_mut()).insert(http::header::CONTENT_LENGTH, leg.len().into());
    req.headers_mut().remove(http::header::TRANSFER_ENCODING);
    *req.body_mut() = RequestBody::Full(leg);
    req.extensions_mut().insert(r.avoid);
    (req.extensions_mut()).insert(RetryUntil(tokio::time::Instant::now() + r.lease, true));
    let mut inner = r.inner;
    let resp = inner.call(req).await?;
    let status = resp.status();
    let mut b = resp.into_body();
    while let Some(Ok(_)) = b.frame().await {}
    match status.is_success() {
        true => Ok(()),
        false => Err(ProxyError::Internal(format!(
            "the release decode answered {status}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    #[test]
    fn a_release_is_a_whole_decode_of_one_token_with_the_prefills_params() {
        let client = br#"{"model":"m","prompt":"p","stream":true,"stream_options":{"include_usage":true},"max_tokens":64,"max_completion_tokens":64,"min_tokens":8,"kv_transfer_params":{"remote_host":"evil"}}"#;
        let params = br#"{"do_remote_prefill":true,"remote_block_ids":[1,2],"remote_port":5600}"#;
        let got: Value =
            serde_json::from_slice(&super::body::release(client, params).unwrap()).unwrap();
        assert_eq!(
            got,
            json!({"model": "m", "prompt": "p", "max_tokens": 1, "max_completion_tokens": 1,
                "stream": false, "kv_transfer_params": {"do_remote_prefill": true,
                "remote_block_ids": [1, 2], "remote_port": 5600}})
        );
    }
}
