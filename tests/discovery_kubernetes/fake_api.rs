//! The fake Kubernetes API server on 127.0.0.1:0: what kube's watcher asks, answered in the shapes
//! a real API server uses (a paginated PodList with a resourceVersion, a chunked watch stream of
//! newline-delimited events replayed from the asked resourceVersion, a 410 `Expired` for a
//! compacted one), with the pods a test sets and the failures it asks for.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::helpers::*;

pub const SELECTOR: &str = "app=vllm";

type Body = BoxBody<Bytes, Infallible>;

/// The fake API server's data: the namespace's pods and the history of their changes.
#[derive(Default)]
pub struct State {
    /// The resourceVersion of the last change.
    rv: u64,
    /// A watch from a resourceVersion older than this is answered 410 Gone (history compacted).
    oldest: u64,
    pub pods: BTreeMap<String, Value>,
    /// Every change since `oldest`, as the watch line sent for it, for watches that resume.
    history: Vec<(u64, Bytes)>,
    /// Open watch streams.
    watches: Vec<mpsc::UnboundedSender<Bytes>>,
    /// List requests answered 500 before lists work again.
    pub failing_lists: usize,
    pub lists: usize,
    /// Every request's path and query, in order.
    pub requests: Vec<String>,
}

impl State {
    pub fn event(&mut self, kind: &str, mut pod: Value) {
        self.rv += 1;
        pod["metadata"]["resourceVersion"] = json!(self.rv.to_string());
        let name = pod["metadata"]["name"].as_str().unwrap().to_string();
        if kind == "DELETED" {
            self.pods.remove(&name);
        } else {
            self.pods.insert(name, pod.clone());
        }
        let line = line(&json!({ "type": kind, "object": pod }));
        self.history.push((self.rv, line.clone()));
        self.watches.retain(|w| w.send(line.clone()).is_ok());
    }

    /// Changes pods unseen by any watch, then forgets the history before them.
    fn compact(&mut self, change: impl FnOnce(&mut BTreeMap<String, Value>)) {
        change(&mut self.pods);
        self.rv += 1;
        for pod in self.pods.values_mut() {
            pod["metadata"]["resourceVersion"] = json!(self.rv.to_string());
        }
        self.oldest = self.rv;
        self.history.clear();
    }
}

fn line(v: &Value) -> Bytes {
    let mut s = v.to_string();
    s.push('\n');
    Bytes::from(s)
}

pub fn expired() -> Bytes {
    line(&json!({ "type": "ERROR", "object": {
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "reason": "Expired", "code": 410,
        "message": "too old resource version",
    }}))
}

/// How a watch learns that its history is gone.
pub enum Expiry {
    /// An `ERROR` 410 event on the open stream, as the API server sends when it compacts.
    InStream,
    /// The stream just ends (the watch's timeout); the watch resumed from its last
    /// resourceVersion is then answered with the 410 event.
    OnResume,
}

pub struct FakeApi {
    pub addr: SocketAddr,
    pub state: Arc<Mutex<State>>,
    pub server: JoinHandle<()>,
}

impl Drop for FakeApi {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl FakeApi {
    pub async fn start(pods: Vec<Value>) -> FakeApi {
        let mut s = State {
            rv: 100,
            oldest: 100,
            ..State::default()
        };
        for p in pods {
            s.event("ADDED", p);
        }
        let state = Arc::new(Mutex::new(s));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let st = state.clone();
        // Accepts until the test drops the fake (which aborts this task).
        let server = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let st = st.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let st = st.clone();
                        async move { Ok::<_, Infallible>(answer(&st, req)) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        FakeApi {
            addr,
            state,
            server,
        }
    }

    pub fn apply(&self, pod: Value) {
        let mut s = self.state.lock().unwrap();
        let kind = match s
            .pods
            .contains_key(pod["metadata"]["name"].as_str().unwrap())
        {
            true => "MODIFIED",
            false => "ADDED",
        };
        s.event(kind, pod);
    }

    pub fn delete(&self, name: &str) {
        let mut s = self.state.lock().unwrap();
        let pod = s.pods.get(name).cloned().unwrap();
        s.event("DELETED", pod);
    }

    /// The watches lose their history while `change` happens unseen: only a new list shows it.
    pub fn expire(&self, how: Expiry, change: impl FnOnce(&mut BTreeMap<String, Value>)) {
        let mut s = self.state.lock().unwrap();
        s.compact(change);
        if let Expiry::InStream = how {
            for w in &s.watches {
                let _ = w.send(expired());
            }
        }
        // Dropping the senders ends the streams.
        s.watches.clear();
    }

    pub fn lists(&self) -> usize {
        self.state.lock().unwrap().lists
    }

    pub fn requests(&self) -> Vec<String> {
        self.state.lock().unwrap().requests.clone()
    }
}

fn answer(state: &Mutex<State>, req: Request<Incoming>) -> Response<Body> {
    let mut s = state.lock().unwrap();
    s.requests.push(req.uri().to_string());
    if req.uri().path() != format!("/api/v1/namespaces/{NS}/pods") {
        return status(StatusCode::NOT_FOUND, "NotFound", "no such path");
    }
    let q: BTreeMap<String, String> = req
        .uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), decode(v)))
        .collect();
    if q.get("labelSelector").map(String::as_str) != Some(SELECTOR) {
        return status(StatusCode::BAD_REQUEST, "BadRequest", "unexpected selector");
    }
    if q.get("watch").map(String::as_str) == Some("true") {
        let Some(from) = q.get("resourceVersion").and_then(|v| v.parse::<u64>().ok()) else {
            return status(StatusCode::BAD_REQUEST, "BadRequest", "watch without RV");
        };
        let (tx, rx) = mpsc::unbounded_channel();
        if from < s.oldest {
            // What the API server does for a watch from a compacted RV: 200, one 410 event.
            let _ = tx.send(expired());
        } else {
            for (_, l) in s.history.iter().filter(|(rv, _)| *rv > from) {
                let _ = tx.send(l.clone());
            }
            s.watches.push(tx);
        }
        let events = futures_util::stream::unfold(rx, |mut rx| async move {
            let line = rx.recv().await?;
            Some((Ok::<_, Infallible>(Frame::data(line)), rx))
        });
        return Response::builder()
            .header("content-type", "application/json")
            .body(BodyExt::boxed(StreamBody::new(events)))
            .unwrap();
    }
    if s.failing_lists > 0 {
        s.failing_lists -= 1;
        return status(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalError",
            "etcd is sad",
        );
    }
    s.lists += 1;
    // Pages of `limit` pods (kube asks for 500), `continue` being the next offset.
    let pods: Vec<&Value> = s.pods.values().collect();
    let from = q.get("continue").and_then(|c| c.parse().ok()).unwrap_or(0);
    let limit = q
        .get("limit")
        .and_then(|l| l.parse().ok())
        .unwrap_or(usize::MAX);
    let page: Vec<&Value> = pods.iter().skip(from).take(limit).copied().collect();
    let next = from + page.len();
    let mut metadata = json!({ "resourceVersion": s.rv.to_string() });
    if next < pods.len() {
        metadata["continue"] = json!(next.to_string());
    }
    let body =
        json!({ "kind": "PodList", "apiVersion": "v1", "metadata": metadata, "items": page });
    json_response(StatusCode::OK, &body)
}

pub fn status(code: StatusCode, reason: &str, message: &str) -> Response<Body> {
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "reason": reason, "message": message, "code": code.as_u16(),
    });
    json_response(code, &body)
}

fn json_response(code: StatusCode, v: &Value) -> Response<Body> {
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(BodyExt::boxed(Full::new(Bytes::from(v.to_string()))))
        .unwrap()
}

/// Percent-decoding of a query value (`app%3Dvllm`).
fn decode(v: &str) -> String {
    let b = v.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match (b[i], b.get(i + 1..i + 3)) {
            (b'%', Some(hex)) => {
                let hex = std::str::from_utf8(hex).unwrap();
                out.push(u8::from_str_radix(hex, 16).unwrap());
                i += 3;
            }
            (b'+', _) => {
                out.push(b' ');
                i += 1;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).unwrap()
}
