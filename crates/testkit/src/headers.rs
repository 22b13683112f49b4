//! A stand-in engine that records the headers it is sent: what rankgate forwards, checked.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{HeaderMap, Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use tokio::net::TcpListener;
use tokio::sync::watch;

use super::loopback;

/// What a real vLLM 0.32 with `--data-parallel-size 2` served on `/metrics`.
const METRICS: &str = include_str!("../../../tests/fixtures/vllm-0.32-dp2-metrics.txt");

/// A stand-in vLLM (DP=2) that records the headers of every request it is sent besides the
/// router's own polls. The simulated engine does not keep headers; this one exists for that.
pub struct HeaderEngine {
    pub url: String,
    seen: Arc<Mutex<Vec<HeaderMap>>>,
    _stop: watch::Sender<bool>,
}

impl HeaderEngine {
    pub async fn start() -> HeaderEngine {
        let listener = TcpListener::bind(loopback()).await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (stop, stop_rx) = watch::channel(false);
        let record = seen.clone();
        tokio::spawn(rankgate::http::serve(
            listener,
            move |req: Request<Incoming>| {
                let record = record.clone();
                async move { Ok(answer(&record, &req)) }
            },
            stop_rx,
        ));
        HeaderEngine {
            url,
            seen,
            _stop: stop,
        }
    }

    /// The headers of the last request an engine client sent.
    pub fn last(&self) -> HeaderMap {
        self.seen
            .lock()
            .unwrap()
            .last()
            .cloned()
            .expect("the engine saw no request")
    }
}

fn answer(record: &Mutex<Vec<HeaderMap>>, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let (ctype, body): (&str, &str) = match req.uri().path() {
        "/metrics" => ("text/plain; version=0.0.4", METRICS),
        "/health" => ("text/plain", ""),
        "/v1/models" => (
            "application/json",
            r#"{"object":"list","data":[{"id":"tiny-llama","object":"model"}]}"#,
        ),
        _ => {
            record.lock().unwrap().push(req.headers().clone());
            (
                "application/json",
                r#"{"id":"cmpl-1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"}}]}"#,
            )
        }
    };
    let mut b = Response::builder()
        .header("content-type", ctype)
        // As vLLM's server answers by default: any origin.
        .header("access-control-allow-origin", "*");
    // Asked for by the request (rankgate forwards the header): an engine that names itself, as
    // a build, a balancer or a proxy in front of it would.
    if req.headers().contains_key(NAME_YOURSELF) {
        for (k, v) in NAMING {
            b = b.header(k, v);
        }
    }
    // Asked for: one header of that many bytes.
    if let Some(n) =
        (req.headers().get(HUGE_HEADER)).and_then(|v| v.to_str().ok()?.parse::<usize>().ok())
    {
        b = b.header("x-huge", "h".repeat(n));
    }
    b.body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap()
}

/// A request header that makes [`HeaderEngine`] answer with [`NAMING`].
pub const NAME_YOURSELF: &str = "x-test-name-yourself";
/// A request header whose number makes [`HeaderEngine`] answer with an `x-huge` header that long.
pub const HUGE_HEADER: &str = "x-test-huge-header";
/// The headers that name an engine, as [`HeaderEngine`] sends them when asked.
pub const NAMING: [(&str, &str); 8] = [
    ("server", "vllm-engine/10.77.0.9:8000"),
    ("via", "1.1 gpu-node-7.internal"),
    ("alt-svc", "h2=\"gpu-node-7.internal:8443\""),
    ("set-cookie", "node=gpu-node-7; Path=/"),
    ("x-sim-rank", "1"),
    ("x-data-parallel-rank", "1"),
    ("x-served-by", "gpu-node-7"),
    ("x-powered-by", "vllm 10.77.0.9"),
];

impl HeaderEngine {
    /// Its `[[engines]]` table: vLLM, DP=2, polled through its `/metrics`; `more`: more keys.
    pub fn toml(&self, more: &str) -> String {
        format!(
            "[[engines]]\nurl = \"{}\"\nflavor = \"vllm\"\ndp_size = 2\ntelemetry = [\"prometheus\"]\n{more}\n",
            self.url
        )
    }
}
