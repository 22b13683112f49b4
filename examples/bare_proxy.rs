//! Benchmark baseline: a bare hyper 1 reverse proxy with no routing logic at all, built on the
//! same accept loop and client as rankgate. `bench/overhead.sh` runs it beside rankgate so that what
//! rankgate adds on the request path shows as a ratio measured in one run.
//!
//! cargo run --release --example bare_proxy -- LISTEN_ADDR UPSTREAM_HOST:PORT

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use http::uri::{Authority, Scheme};
use http::{Request, Response, StatusCode, Uri};
use hyper::body::Incoming;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let listen: SocketAddr = args.next().unwrap_or_default().parse()?;
    let upstream: Authority = args.next().unwrap_or_default().parse()?;
    let client: rankgate::http::HttpClient<Incoming> =
        rankgate::http::client(Duration::from_secs(2));
    let listener = tokio::net::TcpListener::bind(listen).await?;
    let (_tx, rx) = tokio::sync::watch::channel(false);
    let handler = move |req: Request<Incoming>| {
        let client = client.clone();
        let upstream = upstream.clone();
        async move {
            let (mut parts, body) = req.into_parts();
            let mut uri = http::uri::Parts::default();
            uri.scheme = Some(Scheme::HTTP);
            uri.authority = Some(upstream);
            uri.path_and_query = parts.uri.path_and_query().cloned();
            parts.uri = Uri::from_parts(uri).unwrap_or_default();
            parts.headers.remove(http::header::HOST);
            let resp: Response<rankgate::proxy::ProxyBody> =
                match client.request(Request::from_parts(parts, body)).await {
                    Ok(r) => r.map(|b| {
                        rankgate::proxy::ProxyBody::upstream(
                            b,
                            rankgate::proxy::Ending::Cut,
                            Duration::from_secs(300),
                            None,
                            rankgate::proxy::Exposure::default(),
                        )
                    }),
                    Err(e) => rankgate::http::openai_error(
                        StatusCode::BAD_GATEWAY,
                        "UpstreamError",
                        &e.to_string(),
                    ),
                };
            Ok::<_, Infallible>(resp)
        }
    };
    rankgate::http::serve(listener, handler, rx).await;
    Ok(())
}
