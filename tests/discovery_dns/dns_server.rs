//! An in-process authoritative DNS server on 127.0.0.1:0 (hickory-server) serving one name whose
//! records and behaviour (answer, SERVFAIL, silence) a test sets.

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};

use hickory_server::authority::MessageResponseBuilder;
use hickory_server::proto::op::{Header, ResponseCode};
use hickory_server::proto::rr::rdata::{A, AAAA};
use hickory_server::proto::rr::{LowerName, Name, RData, Record, RecordType};
use hickory_server::server::{Request, RequestHandler, ResponseHandler, ResponseInfo};
use hickory_server::ServerFuture;
use tokio::net::UdpSocket;
use tokio::sync::watch;

use crate::helpers::*;

pub const NAME: &str = "engines.rankgate.test.";

/// A long TTL on every record: discovery must not cache it.
const TTL: u32 = 300;

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Mode {
    /// Answer from `ips`: records, or NOERROR with none (NODATA).
    Answer,
    /// NXDOMAIN: the name does not exist.
    Gone,
    ServFail,
    /// A answered from `ips`, AAAA SERVFAIL: one family's server trouble.
    ServFailAaaa,
    /// Read the query and never answer.
    Silent,
}

struct Zone {
    mode: Mode,
    ips: Vec<IpAddr>,
}

/// Answers A and AAAA for [`NAME`] from the shared zone; counts the queries it reads.
struct Handler {
    pub name: LowerName,
    zone: Arc<Mutex<Zone>>,
    queries: watch::Sender<u64>,
}

#[async_trait::async_trait]
impl RequestHandler for Handler {
    async fn handle_request<R: ResponseHandler>(
        &self,
        request: &Request,
        mut response: R,
    ) -> ResponseInfo {
        self.queries.send_modify(|n| *n += 1);
        let mut header = Header::response_from_request(request.header());
        header.set_authoritative(true);
        let Ok(info) = request.request_info() else {
            header.set_response_code(ResponseCode::FormErr);
            return header.into();
        };
        let (mode, ips) = {
            let z = self.zone.lock().unwrap();
            (z.mode, z.ips.clone())
        };
        let mode = match mode {
            _ if info.query.name() != &self.name => Mode::Gone,
            Mode::ServFailAaaa if info.query.query_type() == RecordType::AAAA => Mode::ServFail,
            Mode::ServFailAaaa => Mode::Answer,
            m => m,
        };
        let name = Name::from(info.query.name());
        let records: Vec<Record> = match mode {
            Mode::Silent => return header.into(),
            Mode::Gone => {
                header.set_response_code(ResponseCode::NXDomain);
                vec![]
            }
            Mode::ServFail | Mode::ServFailAaaa => {
                header.set_response_code(ResponseCode::ServFail);
                vec![]
            }
            Mode::Answer => ips
                .iter()
                .filter_map(|ip| match (ip, info.query.query_type()) {
                    (IpAddr::V4(a), RecordType::A) => Some(RData::A(A(*a))),
                    (IpAddr::V6(a), RecordType::AAAA) => Some(RData::AAAA(AAAA(*a))),
                    _ => None,
                })
                .map(|rdata| Record::from_rdata(name.clone(), TTL, rdata))
                .collect(),
        };
        let message = MessageResponseBuilder::from_message_request(request).build(
            header,
            &records,
            &[],
            &[],
            &[],
        );
        response
            .send_response(message)
            .await
            .unwrap_or(header.into())
    }
}

pub struct DnsServer {
    pub addr: SocketAddr,
    zone: Arc<Mutex<Zone>>,
    queries: watch::Receiver<u64>,
    // Dropping it stops the server (its tasks live in its JoinSet).
    _server: ServerFuture<Handler>,
}

impl DnsServer {
    pub async fn start(mode: Mode, ips: &[&str]) -> DnsServer {
        let zone = Arc::new(Mutex::new(Zone {
            mode,
            ips: ips.iter().map(|s| s.parse().unwrap()).collect(),
        }));
        let (queries_tx, queries) = watch::channel(0);
        let socket = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = socket.local_addr().unwrap();
        let mut server = ServerFuture::new(Handler {
            name: LowerName::from(Name::from_ascii(NAME).unwrap()),
            zone: zone.clone(),
            queries: queries_tx,
        });
        server.register_socket(socket);
        DnsServer {
            addr,
            zone,
            queries,
            _server: server,
        }
    }

    pub fn set(&self, mode: Mode, ips: &[&str]) {
        let mut z = self.zone.lock().unwrap();
        z.mode = mode;
        z.ips = ips.iter().map(|s| s.parse().unwrap()).collect();
    }

    /// Waits until the server has read `more` queries beyond those read so far.
    pub async fn await_queries(&mut self, more: u64) {
        let target = *self.queries.borrow_and_update() + more;
        tokio::time::timeout(WAIT, self.queries.wait_for(|n| *n >= target))
            .await
            .expect("discovery keeps asking")
            .unwrap();
    }
}
