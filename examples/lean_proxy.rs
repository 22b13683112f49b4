//! The floor for bench/instructions.sh: the leanest reverse proxy hyper makes. One
//! current-thread runtime, HTTP/1.1 only, and for each client connection one upstream
//! connection of its own (hyper's client connection, no pool, no executor): every request is
//! parsed, re-sent and answered, and nothing else happens.
//!
//! cargo run --release --example lean_proxy -- LISTEN_ADDR UPSTREAM_HOST:PORT

use std::net::SocketAddr;

use http::uri::Authority;
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::sync::Mutex;

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let listen: SocketAddr = args.next().unwrap_or_default().parse()?;
    let upstream: Authority = args.next().unwrap_or_default().parse()?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        // A tick every 100 ms: callgrind serves `callgrind_control` (zero, dump) only when the
        // process runs, and an idle one-thread proxy would otherwise sleep through them.
        tokio::spawn(async {
            let mut tick = tokio::time::interval(std::time::Duration::from_millis(100));
            loop {
                tick.tick().await;
            }
        });
        let listener = tokio::net::TcpListener::bind(listen).await?;
        loop {
            let (client, _) = listener.accept().await?;
            let _ = client.set_nodelay(true);
            let upstream = upstream.clone();
            tokio::spawn(async move {
                if let Err(e) = serve(client, upstream).await {
                    eprintln!("lean_proxy: {e}");
                }
            });
        }
    })
}

async fn serve(client: tokio::net::TcpStream, upstream: Authority) -> anyhow::Result<()> {
    let engine = tokio::net::TcpStream::connect(upstream.as_str()).await?;
    engine.set_nodelay(true)?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(engine)).await?;
    tokio::spawn(conn);
    // One request at a time on an HTTP/1.1 connection, so the lock is never contended.
    let sender = std::sync::Arc::new(Mutex::new(sender));
    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
        let sender = sender.clone();
        async move {
            let mut sender = sender.lock().await;
            let resp = match sender.send_request(req).await {
                Ok(r) => r.map(http_body_util::Either::Left),
                Err(e) => {
                    let mut r = Response::new(http_body_util::Either::Right(
                        http_body_util::Full::new(bytes::Bytes::from(e.to_string())),
                    ));
                    *r.status_mut() = StatusCode::BAD_GATEWAY;
                    r
                }
            };
            Ok::<_, std::convert::Infallible>(resp)
        }
    });
    hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(client), svc)
        .await?;
    Ok(())
}
