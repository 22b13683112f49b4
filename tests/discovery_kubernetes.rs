//! Kubernetes discovery against a fake API server over real HTTP on 127.0.0.1:0, reached through
//! a kubeconfig file like any cluster. The fake answers what kube's watcher asks, in the shapes a
//! real API server uses: a paginated PodList carrying a resourceVersion, then a chunked watch
//! stream of newline-delimited events replayed from the asked resourceVersion, and for a watch
//! from a compacted resourceVersion an `ERROR` event with a 410 `Expired` Status.
#![cfg(feature = "kubernetes")]

mod common;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::TokioIo;
use rankgate::config::{Config, Discovery};
use rankgate::discovery::kubernetes::{run, DP_SIZE_ANNOTATION, START_RANK_ANNOTATION};
use rankgate::worker::Engine;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

const NS: &str = "llm";
const SELECTOR: &str = "app=vllm";
/// Longest wait for anything the discovery should do (kube's watcher backs off up to a few
/// seconds between attempts after an error).
const WAIT: Duration = Duration::from_secs(10);

type Body = BoxBody<Bytes, Infallible>;

/// The fake API server's data: the namespace's pods and the history of their changes.
#[derive(Default)]
struct State {
    /// The resourceVersion of the last change.
    rv: u64,
    /// A watch from a resourceVersion older than this is answered 410 Gone (history compacted).
    oldest: u64,
    pods: BTreeMap<String, Value>,
    /// Every change since `oldest`, as the watch line sent for it, for watches that resume.
    history: Vec<(u64, Bytes)>,
    /// Open watch streams.
    watches: Vec<mpsc::UnboundedSender<Bytes>>,
    /// List requests answered 500 before lists work again.
    failing_lists: usize,
    lists: usize,
    /// Every request's path and query, in order.
    requests: Vec<String>,
}

impl State {
    fn event(&mut self, kind: &str, mut pod: Value) {
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

fn expired() -> Bytes {
    line(&json!({ "type": "ERROR", "object": {
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "reason": "Expired", "code": 410,
        "message": "too old resource version",
    }}))
}

/// How a watch learns that its history is gone.
enum Expiry {
    /// An `ERROR` 410 event on the open stream, as the API server sends when it compacts.
    InStream,
    /// The stream just ends (the watch's timeout); the watch resumed from its last
    /// resourceVersion is then answered with the 410 event.
    OnResume,
}

struct FakeApi {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    server: JoinHandle<()>,
}

impl Drop for FakeApi {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl FakeApi {
    async fn start(pods: Vec<Value>) -> FakeApi {
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

    fn apply(&self, pod: Value) {
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

    fn delete(&self, name: &str) {
        let mut s = self.state.lock().unwrap();
        let pod = s.pods.get(name).cloned().unwrap();
        s.event("DELETED", pod);
    }

    /// The watches lose their history while `change` happens unseen: only a new list shows it.
    fn expire(&self, how: Expiry, change: impl FnOnce(&mut BTreeMap<String, Value>)) {
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

    fn lists(&self) -> usize {
        self.state.lock().unwrap().lists
    }

    fn requests(&self) -> Vec<String> {
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

fn status(code: StatusCode, reason: &str, message: &str) -> Response<Body> {
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

/// A pod of the engine Deployment: the `http` container port is 8000.
fn pod(name: &str, ip: &str, ready: bool) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": name, "namespace": NS, "uid": format!("uid-{name}"),
            "labels": { "app": "vllm" },
        },
        "spec": { "containers": [{
            "name": "vllm", "image": "vllm/vllm-openai",
            "ports": [
                { "name": "http", "containerPort": 8000, "protocol": "TCP" },
                { "name": "metrics", "containerPort": 9100, "protocol": "TCP" },
            ],
        }]},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [
                { "type": "Initialized", "status": "True" },
                { "type": "Ready", "status": if ready { "True" } else { "False" } },
                { "type": "ContainersReady", "status": if ready { "True" } else { "False" } },
            ],
        },
    })
}

fn annotated(mut pod: Value, key: &str, value: &str) -> Value {
    pod["metadata"]["annotations"][key] = json!(value);
    pod
}

/// A temp directory holding the kubeconfig, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let dir = std::env::temp_dir().join(format!(
            "rankgate-kube-{}-{nanos}-{}",
            std::process::id(),
            rand_suffix()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A kubeconfig for a cluster at `addr`, plain HTTP, no credentials.
fn write_kubeconfig(path: &Path, addr: SocketAddr) {
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://{addr}\n\
         contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n\
         current-context: fake\nusers:\n- name: fake\n  user: {{}}\n"
    );
    std::fs::write(path, text).unwrap();
}

fn discovery(kubeconfig: &Path, extra: &str) -> Discovery {
    let text = format!(
        "[[discovery]]\nkind = \"kubernetes\"\nnamespace = \"{NS}\"\nselector = \"{SELECTOR}\"\n\
         port = \"http\"\nflavor = \"vllm\"\ndp_size = 2\nkubeconfig = {:?}\n{extra}",
        kubeconfig.display().to_string()
    );
    let mut c = Config::from_str(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    c.discovery.remove(0)
}

/// A discovery task watching `api`, its sets, and its shutdown switch.
struct Watching {
    sets: mpsc::Receiver<Vec<Engine>>,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
    _dir: TempDir,
}

fn start(api: &FakeApi) -> Watching {
    let dir = TempDir::new();
    let path = dir.0.join("kubeconfig");
    write_kubeconfig(&path, api.addr);
    start_with(&path, dir)
}

fn start_with(kubeconfig: &Path, dir: TempDir) -> Watching {
    let (found, sets) = mpsc::channel(16);
    let (stop, shutdown) = watch::channel(false);
    let task = tokio::spawn(run(discovery(kubeconfig, ""), found, shutdown));
    Watching {
        sets,
        stop,
        task,
        _dir: dir,
    }
}

impl Watching {
    /// The next set sent, as its URLs; panics after [`WAIT`].
    async fn next(&mut self) -> Vec<String> {
        self.next_engines()
            .await
            .iter()
            .map(|e| e.url.to_string())
            .collect()
    }

    async fn next_engines(&mut self) -> Vec<Engine> {
        tokio::time::timeout(WAIT, self.sets.recv())
            .await
            .expect("a set within the wait")
            .expect("the discovery task is running")
    }
}

#[tokio::test]
async fn the_first_list_gives_the_ready_pods_at_their_named_port() {
    let api = FakeApi::start(vec![
        annotated(pod("vllm-0", "127.0.0.10", true), DP_SIZE_ANNOTATION, "4"),
        pod("vllm-1", "127.0.0.11", false),
    ])
    .await;
    let mut w = start(&api);
    let set = w.next_engines().await;
    assert_eq!(set.len(), 1, "{set:?}");
    assert_eq!(&*set[0].url, "http://127.0.0.10:8000");
    assert_eq!((set[0].dp_size, set[0].start_rank), (4, 0));
    // A change the watch carries (the set is sent before the watch is asked for).
    api.apply(pod("vllm-1", "127.0.0.11", true));
    assert_eq!(w.next().await.len(), 2);
    // What kube asked: a page of the list by selector, then a watch from the list's
    // resourceVersion (the fake's 102 after its two pods).
    let requests = api.requests();
    eprintln!("requests: {requests:?}");
    let list = &requests[0];
    assert!(list.contains("labelSelector=app%3Dvllm") && list.contains("limit=500"));
    let watch = &requests[1];
    assert!(watch.contains("watch=true") && watch.contains("resourceVersion=102"));
}

#[tokio::test]
async fn watch_events_move_pods_in_and_out() {
    let api = FakeApi::start(vec![]).await;
    let mut w = start(&api);
    assert_eq!(
        w.next().await,
        Vec::<String>::new(),
        "an empty fleet is sent"
    );
    api.apply(pod("vllm-0", "127.0.0.10", false));
    api.apply(pod("vllm-0", "127.0.0.10", true));
    assert_eq!(w.next().await, ["http://127.0.0.10:8000"]);
    api.apply(pod("vllm-1", "127.0.0.11", true));
    assert_eq!(
        w.next().await,
        ["http://127.0.0.10:8000", "http://127.0.0.11:8000"]
    );
    api.apply(pod("vllm-0", "127.0.0.10", false));
    assert_eq!(w.next().await, ["http://127.0.0.11:8000"]);
    // Terminating: still Ready while it drains, but no longer given requests.
    let mut terminating = pod("vllm-1", "127.0.0.11", true);
    terminating["metadata"]["deletionTimestamp"] = json!("2025-01-01T00:00:00Z");
    api.apply(terminating);
    assert_eq!(w.next().await, Vec::<String>::new());
    api.apply(pod("vllm-2", "127.0.0.12", true));
    assert_eq!(w.next().await, ["http://127.0.0.12:8000"]);
    api.delete("vllm-2");
    assert_eq!(w.next().await, Vec::<String>::new());
    assert_eq!(api.lists(), 1, "events came by the watch, not by lists");
}

#[tokio::test]
async fn an_expired_watch_lists_again() {
    let api = FakeApi::start(vec![
        pod("vllm-0", "127.0.0.10", true),
        pod("vllm-1", "127.0.0.11", true),
    ])
    .await;
    let mut w = start(&api);
    assert_eq!(
        w.next().await,
        ["http://127.0.0.10:8000", "http://127.0.0.11:8000"]
    );
    // The API server says 410 on the open stream; meanwhile vllm-0 went and vllm-2 came.
    api.expire(Expiry::InStream, |pods| {
        pods.remove("vllm-0");
        pods.insert("vllm-2".into(), pod("vllm-2", "127.0.0.12", true));
    });
    assert_eq!(
        w.next().await,
        ["http://127.0.0.11:8000", "http://127.0.0.12:8000"]
    );
    assert_eq!(api.lists(), 2);
    // The stream ends and its resumption is refused with 410: listed again.
    api.expire(Expiry::OnResume, |pods| {
        pods.insert("vllm-1".into(), pod("vllm-1", "127.0.0.11", false));
        pods.insert("vllm-3".into(), pod("vllm-3", "127.0.0.13", true));
    });
    assert_eq!(
        w.next().await,
        ["http://127.0.0.12:8000", "http://127.0.0.13:8000"]
    );
    assert_eq!(api.lists(), 3);
    // And the new watch carries events.
    api.delete("vllm-3");
    assert_eq!(w.next().await, ["http://127.0.0.12:8000"]);
}

#[tokio::test]
async fn a_failing_api_server_keeps_the_last_set_until_it_answers() {
    let api = FakeApi::start(vec![pod("vllm-0", "127.0.0.10", true)]).await;
    let mut w = start(&api);
    assert_eq!(w.next().await, ["http://127.0.0.10:8000"]);
    api.state.lock().unwrap().failing_lists = 2;
    api.expire(Expiry::InStream, |pods| {
        pods.insert("vllm-1".into(), pod("vllm-1", "127.0.0.11", true));
    });
    // Nothing is sent while lists fail; the first list that works gives the new set.
    assert_eq!(
        w.next().await,
        ["http://127.0.0.10:8000", "http://127.0.0.11:8000"]
    );
    assert_eq!(api.state.lock().unwrap().failing_lists, 0);
}

#[tokio::test]
async fn a_pod_with_a_bad_annotation_is_skipped_and_the_others_kept() {
    let api = FakeApi::start(vec![
        pod("vllm-0", "127.0.0.10", true),
        annotated(
            pod("vllm-1", "127.0.0.11", true),
            DP_SIZE_ANNOTATION,
            "four",
        ),
    ])
    .await;
    let mut w = start(&api);
    assert_eq!(w.next().await, ["http://127.0.0.10:8000"]);
    api.apply(annotated(
        pod("vllm-2", "127.0.0.12", true),
        START_RANK_ANNOTATION,
        "-8",
    ));
    api.apply(pod("vllm-3", "127.0.0.13", true));
    assert_eq!(
        w.next().await,
        ["http://127.0.0.10:8000", "http://127.0.0.13:8000"]
    );
    // Fixed: it joins.
    api.apply(annotated(
        pod("vllm-1", "127.0.0.11", true),
        DP_SIZE_ANNOTATION,
        "4",
    ));
    let set = w.next_engines().await;
    assert_eq!(set.len(), 3);
    assert_eq!(
        (&*set[1].url, set[1].dp_size),
        ("http://127.0.0.11:8000", 4)
    );
}

#[tokio::test]
async fn shutdown_ends_the_task() {
    let api = FakeApi::start(vec![pod("vllm-0", "127.0.0.10", true)]).await;
    let mut w = start(&api);
    assert_eq!(w.next().await, ["http://127.0.0.10:8000"]);
    w.stop.send(true).unwrap();
    tokio::time::timeout(WAIT, w.task)
        .await
        .expect("stopped within the wait")
        .unwrap();
}

#[tokio::test]
async fn a_dropped_receiver_ends_the_task() {
    let api = FakeApi::start(vec![pod("vllm-0", "127.0.0.10", true)]).await;
    let mut w = start(&api);
    assert_eq!(w.next().await, ["http://127.0.0.10:8000"]);
    drop(w.sets);
    tokio::time::timeout(WAIT, w.task)
        .await
        .expect("stopped within the wait")
        .unwrap();
}

#[tokio::test]
async fn a_missing_kubeconfig_is_retried_until_it_appears() {
    let api = FakeApi::start(vec![pod("vllm-0", "127.0.0.10", true)]).await;
    let dir = TempDir::new();
    let path = dir.0.join("kubeconfig");
    let mut w = start_with(&path, dir);
    // The spawned task runs (and fails to read the file) before this test task resumes: the
    // runtime is single-threaded and the yield puts the test behind it.
    tokio::task::yield_now().await;
    assert!(w.sets.try_recv().is_err());
    write_kubeconfig(&path, api.addr);
    assert_eq!(w.next().await, ["http://127.0.0.10:8000"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_events_change_the_routers_fleet() {
    let (a, b, port) = common::engines_on_one_port().await;
    let (ea, eb) = (a.url(), b.url());
    let api = FakeApi::start(vec![
        pod("vllm-0", "127.0.0.2", true),
        pod("vllm-1", "127.0.0.3", false),
    ])
    .await;
    let dir = TempDir::new();
    let kubeconfig = dir.0.join("kubeconfig");
    write_kubeconfig(&kubeconfig, api.addr);
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nexpose_worker = \"url\"\n{}\
         [[discovery]]\nkind = \"kubernetes\"\nnamespace = \"{NS}\"\nselector = \"{SELECTOR}\"\n\
         port = {port}\nflavor = \"vllm\"\ndp_size = 2\nkubeconfig = {:?}\n",
        common::FAST,
        kubeconfig.display().to_string()
    );
    let router = rankgate::app::Router::start(Config::from_str(&text).unwrap())
        .await
        .unwrap();
    let only = |url: &str| {
        let url = url.to_string();
        move |ids: &[String]| ids.len() == 2 && ids.iter().all(|i| i.starts_with(&url))
    };
    let both = |ids: &[String]| ids.len() == 4;

    // The Ready pod is the fleet; the other joins when it becomes Ready.
    common::wait_available(&router, only(&ea)).await;
    api.apply(pod("vllm-1", "127.0.0.3", true));
    common::wait_available(&router, both).await;

    // Not Ready any more: it leaves, and the requests go to the other.
    api.apply(pod("vllm-0", "127.0.0.2", false));
    common::wait_available(&router, only(&eb)).await;
    assert_eq!(common::workers(&router).await.len(), 2);
    let before = a.requests_received();
    for _ in 0..10 {
        let reply = common::chat(router.addr, 2).await;
        assert_eq!(reply.status, 200);
        assert!(reply.worker().starts_with(&eb), "{}", reply.worker());
    }
    assert_eq!(a.requests_received(), before);

    // The watch expires while vllm-0 becomes Ready again: the re-list brings it back.
    api.expire(Expiry::InStream, |pods| {
        pods.insert("vllm-0".into(), pod("vllm-0", "127.0.0.2", true));
    });
    common::wait_available(&router, both).await;

    // Deleted: gone from the fleet.
    api.delete("vllm-1");
    common::wait_available(&router, only(&ea)).await;
    assert_eq!(common::workers(&router).await.len(), 2);
    assert_eq!(common::chat(router.addr, 2).await.status, 200);
    router.shutdown().await;
}
