//! SGLang's disaggregation (bootstrap): both legs at once.

use bytes::Bytes;

use super::{Disagg, Head, Split};
use crate::proxy::error::ProxyError;
use crate::proxy::layer::{Answer, Below};
use crate::upstream::RequestBody;

pub(super) async fn serve<S>(_legs: Disagg<S>, _head: Head, _client: Bytes, _split: Split) -> Answer
where
    S: Below<RequestBody> + Clone + Send + 'static,
{
    Err(ProxyError::NotDisaggregable("SGLang: in progress".into()))
}
