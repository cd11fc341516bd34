//! Real parts for the egress tests, on loopback only:
//!
//! - [`TestCa`]: a certificate authority the test makes (rcgen), written as a PEM file a
//!   route's `ca_file` names, and a server certificate for the test names;
//! - [`Upstream`]: an HTTPS server (rustls, hyper) on an address of 127/8 (`127.0.0.2`
//!   for the one a route may reach), recording each request (its peer address, method,
//!   path, headers and body) and answering by path: `/echo` (the request as JSON),
//!   `/credential` (the `authorization` header, the `x-api-key` header and the query echoed
//!   as text; `/escaped-credential` the same as JSON with `/` escaped, `/zipped-credential`
//!   gzipped, `/te-zipped-credential` in `transfer-encoding: gzip, chunked`), `/self-redirect` (a 302 to `/credential` beside it, by its absolute path),
//!   `/cookie` (a `Set-Cookie`), `/redirect?to=URL` (a 302), `/slow` (never
//!   answers), `/endless` (a body that never ends), `/stall?kb=K` (K KiB, then nothing), `/gate?n=N&kb=K` (K KiB once N requests
//!   with its query are in), `/bomb` (a gzip bomb: 128 KiB that
//!   inflate to 128 MiB, `content-encoding: gzip`), `/big?kb=N`, `/html`;
//! - [`Dns`]: a DNS server on 127.0.0.1 (UDP) answering `A` queries from a table, each name
//!   a list of answers given in turn (the rebinding test's `127.0.0.2`, then `127.0.0.3`),
//!   and counting the queries per name.

use std::collections::HashMap;
use std::convert::Infallible;
use std::io::Write as _;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;

/// The names the test's certificate holds (the DNS table maps them to 127/8).
pub const NAMES: &[&str] = &[
    "egress.test",
    "api.egress.test",
    "rebind.test",
    "other.test",
    "meta.test",
];

/// A test's certificate authority and its server certificate.
pub struct TestCa {
    /// The CA's certificate, PEM, in a file of the test's temp dir.
    pub pem_file: PathBuf,
    ca_cert: rustls::pki_types::CertificateDer<'static>,
    server_cert: rustls::pki_types::CertificateDer<'static>,
    server_key: rustls::pki_types::PrivateKeyDer<'static>,
    _dir: tempfile::TempDir,
}

impl TestCa {
    /// A new CA (its file readable by the service user) and a server certificate for
    /// [`NAMES`].
    pub fn new() -> Self {
        use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
        let ca_key = KeyPair::generate().expect("a CA key");
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "roundtable egress test CA");
        let ca = ca_params.self_signed(&ca_key).expect("a CA certificate");
        let key = KeyPair::generate().expect("a server key");
        let params =
            CertificateParams::new(NAMES.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .expect("server params");
        let cert = params
            .signed_by(&key, &ca, &ca_key)
            .expect("a server certificate");
        let dir = tempfile::Builder::new()
            .prefix("rtb-egress-ca-")
            .tempdir_in("/tmp")
            .expect("a temp dir");
        let pem_file = dir.path().join("ca.pem");
        std::fs::File::create(&pem_file)
            .and_then(|mut f| f.write_all(ca.pem().as_bytes()))
            .expect("write the CA");
        Self {
            pem_file,
            ca_cert: ca.der().clone(),
            server_cert: cert.der().clone(),
            server_key: rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
            _dir: dir,
        }
    }

    /// A TLS client trusting this CA alone (the bench's direct path: the request the broker
    /// sends, without the broker).
    pub fn client_config(&self) -> Arc<rustls::ClientConfig> {
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(self.ca_cert.clone())
            .expect("the CA's certificate");
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("protocol versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Arc::new(config)
    }

    fn server_config(&self) -> Arc<rustls::ServerConfig> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("protocol versions")
            .with_no_client_auth()
            .with_single_cert(vec![self.server_cert.clone()], self.server_key.clone_key())
            .expect("a server config");
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Arc::new(config)
    }
}

impl std::fmt::Debug for TestCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCa").finish_non_exhaustive()
    }
}

impl Default for TestCa {
    fn default() -> Self {
        Self::new()
    }
}

/// One request the upstream received.
#[derive(Debug, Clone)]
pub struct Seen {
    /// The peer's address.
    pub peer: SocketAddr,
    /// The address it was received on.
    pub local: SocketAddr,
    /// The method.
    pub method: String,
    /// The path and query.
    pub uri: String,
    /// The headers, lower-case names.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: Vec<u8>,
}

/// An HTTPS test server (see the module).
pub struct Upstream {
    /// Where it listens.
    pub addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    task: tokio::task::JoinHandle<()>,
}

type Body = http_body_util::combinators::BoxBody<Bytes, Infallible>;

impl Upstream {
    /// Starts on `ip` (of 127/8), on a free port (or `port`).
    pub async fn start(ca: &TestCa, ip: Ipv4Addr, port: u16) -> Self {
        let listener = tokio::net::TcpListener::bind((ip, port))
            .await
            .expect("bind the test upstream");
        let addr = listener.local_addr().unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(ca.server_config());
        let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
        let record = seen.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, peer)) = listener.accept().await else {
                    continue;
                };
                // As a web server sets it (nginx's `tcp_nodelay on`): without it, its
                // answer waits on the client's delayed ACK of its session tickets (40 ms).
                tcp.set_nodelay(true).ok();
                let (acceptor, record) = (acceptor.clone(), record.clone());
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    crate::http::serve_connection(tls, move |req| {
                        answer(req, peer, addr, record.clone())
                    })
                    .await;
                });
            }
        });
        Self { addr, seen, task }
    }

    /// The requests received so far.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream").finish_non_exhaustive()
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn answer(
    req: hyper::Request<hyper::body::Incoming>,
    peer: SocketAddr,
    local: SocketAddr,
    record: Arc<Mutex<Vec<Seen>>>,
) -> hyper::Response<Body> {
    let method = req.method().to_string();
    let uri = req.uri().to_string();
    let path = req.uri().path().to_owned();
    let query = req.uri().query().unwrap_or("").to_owned();
    let headers: Vec<(String, String)> = req
        .headers()
        .iter()
        .map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap_or("?").to_owned()))
        .collect();
    let body = crate::http::body(req).await;
    let seen = Seen {
        peer,
        local,
        method: method.clone(),
        uri: uri.clone(),
        headers: headers.clone(),
        body: body.to_vec(),
    };
    record.lock().unwrap().push(seen);
    let header = |name: &str| {
        headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    let text = |status: u16, body: String| {
        hyper::Response::builder()
            .status(status)
            .header("content-type", "text/plain")
            .body(Body::new(Full::new(Bytes::from(body))))
            .unwrap()
    };
    let param = |name: &str| {
        query
            .split('&')
            .find_map(|p| p.strip_prefix(&format!("{name}=")))
            .map(|v| v.replace("%3A", ":").replace("%2F", "/"))
    };
    match path.as_str() {
        p if p.ends_with("/echo") => {
            let json = serde_json::json!({
                "method": method,
                "uri": uri,
                "headers": headers,
                "body": String::from_utf8_lossy(&body),
            });
            hyper::Response::builder()
                .header("content-type", "application/json")
                .body(Body::new(Full::new(Bytes::from(json.to_string()))))
                .unwrap()
        }
        p if p.ends_with("/credential") => text(
            200,
            format!(
                "authorization={} x-api-key={} query={query}",
                header("authorization"),
                header("x-api-key")
            ),
        ),
        p if p.ends_with("/escaped-credential") => {
            // `/credential`'s echo as JSON with each `/` escaped, as PHP's encoder writes it.
            let json = serde_json::json!({
                "authorization": header("authorization"),
                "x-api-key": header("x-api-key"),
                "query": query,
            });
            let body = json.to_string().replace('/', "\\/");
            hyper::Response::builder()
                .header("content-type", "application/json")
                .body(Body::new(Full::new(Bytes::from(body))))
                .unwrap()
        }
        p if p.ends_with("/zipped-credential") => {
            // `/credential`'s echo, gzipped although the broker asked for identity.
            let mut enc =
                flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
            let echo = format!(
                "authorization={} x-api-key={} query={query}",
                header("authorization"),
                header("x-api-key")
            );
            enc.write_all(echo.as_bytes()).unwrap();
            hyper::Response::builder()
                .header("content-encoding", "gzip")
                .header("content-type", "text/plain")
                .body(Body::new(Full::new(Bytes::from(enc.finish().unwrap()))))
                .unwrap()
        }
        p if p.ends_with("/te-zipped-credential") => {
            // The same echo in a transfer coding (`gzip, chunked`): hyper takes `chunked`
            // off and hands the client the gzip member as the body.
            let mut enc =
                flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
            let echo = format!("authorization={}", header("authorization"));
            enc.write_all(echo.as_bytes()).unwrap();
            let zipped = Bytes::from(enc.finish().unwrap());
            let frames = futures_util::stream::iter([Ok::<_, Infallible>(
                hyper::body::Frame::data(zipped),
            )]);
            hyper::Response::builder()
                .header("transfer-encoding", "gzip, chunked")
                .header("content-type", "text/plain")
                .body(Body::new(http_body_util::StreamBody::new(frames)))
                .unwrap()
        }
        p if p.ends_with("/cookie") => hyper::Response::builder()
            .header("set-cookie", "session=guest-tracker; Path=/")
            .header("x-kept", "yes")
            // A site posing as the broker: a forged denial and the broker's mark.
            .header("x-roundtable-egress-denied", "method")
            .header("x-roundtable-broker", "1")
            .body(Body::new(Full::new(Bytes::from("cookie set"))))
            .unwrap(),
        p if p.ends_with("/self-redirect") => hyper::Response::builder()
            // To `/credential` beside it, by the absolute path this request came on.
            .status(302)
            .header(
                "location",
                format!("{}/credential", p.trim_end_matches("/self-redirect")),
            )
            .body(Body::new(Full::new(Bytes::new())))
            .unwrap(),
        p if p.ends_with("/redirect") => hyper::Response::builder()
            .status(302)
            .header("location", param("to").unwrap_or_default())
            .body(Body::new(Full::new(Bytes::new())))
            .unwrap(),
        p if p.ends_with("/slow") => {
            std::future::pending::<()>().await;
            unreachable!()
        }
        p if p.ends_with("/endless") => {
            let chunk = Bytes::from(vec![b'x'; 64 * 1024]);
            let frames = futures_util::stream::unfold(chunk, |c| async move {
                Some((Ok::<_, Infallible>(Frame::data(c.clone())), c))
            });
            hyper::Response::builder()
                .body(Body::new(StreamBody::new(frames)))
                .unwrap()
        }
        p if p.ends_with("/bomb") => hyper::Response::builder()
            .header("content-encoding", "gzip")
            .header("content-type", "text/plain")
            .body(Body::new(Full::new(Bytes::from(gzip_bomb()))))
            .unwrap(),
        p if p.ends_with("/stall") => {
            // `kb` KiB of body, then nothing more, ever.
            let kb: usize = param("kb").and_then(|k| k.parse().ok()).unwrap_or(1);
            let first = Bytes::from(vec![b's'; kb * 1024]);
            let frames = futures_util::stream::unfold(Some(first), |next| async move {
                match next {
                    Some(c) => Some((Ok::<_, Infallible>(Frame::data(c)), None)),
                    None => std::future::pending().await,
                }
            });
            hyper::Response::builder()
                .body(Body::new(StreamBody::new(frames)))
                .unwrap()
        }
        p if p.ends_with("/gate") => {
            // Answers (`kb` KiB) once `n` requests with this one's query have arrived: the
            // caller's requests are all in flight at once (20 s at most).
            let n: usize = param("n").and_then(|k| k.parse().ok()).unwrap_or(1);
            let kb: usize = param("kb").and_then(|k| k.parse().ok()).unwrap_or(1);
            for _ in 0..2000 {
                let arrived = record.lock().unwrap().iter().filter(|s| s.uri == uri).count();
                if arrived >= n {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            text(200, "g".repeat(kb * 1024))
        }
        p if p.ends_with("/big") => {
            let kb: usize = param("kb").and_then(|k| k.parse().ok()).unwrap_or(1);
            text(200, "y".repeat(kb * 1024))
        }
        p if p.ends_with("/headers") => {
            // `kb` headers of 1 KiB each (`x-pad-<n>`), a short body.
            let kb: usize = param("kb").and_then(|k| k.parse().ok()).unwrap_or(1);
            let mut answer = hyper::Response::builder();
            for n in 0..kb {
                answer = answer.header(format!("x-pad-{n}"), "p".repeat(1000));
            }
            answer.body(Body::new(Full::new(Bytes::from("padded")))).unwrap()
        }
        p if p.ends_with("/html") => hyper::Response::builder()
            .header("content-type", "text/html")
            .body(Body::new(Full::new(Bytes::from(
                "<html><head><title>T</title><script>evil()</script></head><body><h1>Hello</h1><p>egress &amp; web</p></body></html>",
            ))))
            .unwrap(),
        _ => text(404, format!("no route {path}")),
    }
}

/// A gzip member whose content is 128 MiB of zeros (about 128 KiB compressed, a ratio of
/// a thousand): made once per process.
pub fn gzip_bomb() -> Vec<u8> {
    use std::sync::OnceLock;
    static BOMB: OnceLock<Vec<u8>> = OnceLock::new();
    BOMB.get_or_init(|| {
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        let zeros = vec![0u8; 1 << 20];
        for _ in 0..128 {
            enc.write_all(&zeros).unwrap();
        }
        enc.finish().unwrap()
    })
    .clone()
}

/// A DNS server for the tests (see the module).
pub struct Dns {
    /// Where it answers (UDP).
    pub addr: SocketAddr,
    queries: Arc<Mutex<HashMap<String, u32>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Dns {
    /// Starts on 127.0.0.1 with `table`: each name's answers, one per `A` query in turn
    /// (the last one repeated).
    pub async fn start(table: &[(&str, &[Ipv4Addr])]) -> Self {
        use hickory_proto::op::{Message, MessageType, ResponseCode};
        use hickory_proto::rr::{RData, Record, RecordType};
        let socket = tokio::net::UdpSocket::bind("127.0.0.1:0")
            .await
            .expect("bind the test DNS");
        let addr = socket.local_addr().unwrap();
        let table: HashMap<String, Vec<Ipv4Addr>> = table
            .iter()
            .map(|(n, a)| (format!("{}.", n.trim_end_matches('.')), a.to_vec()))
            .collect();
        let queries: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
        let counts = queries.clone();
        let task = tokio::spawn(async move {
            let mut buf = vec![0u8; 1500];
            loop {
                let Ok((n, from)) = socket.recv_from(&mut buf).await else {
                    continue;
                };
                let Ok(query) = Message::from_vec(&buf[..n]) else {
                    continue;
                };
                let mut reply = Message::new();
                reply
                    .set_id(query.id())
                    .set_message_type(MessageType::Response)
                    .set_recursion_desired(query.recursion_desired())
                    .set_recursion_available(true);
                reply.add_queries(query.queries().to_vec());
                for q in query.queries() {
                    let name = q.name().to_ascii().to_ascii_lowercase();
                    let Some(answers) = table.get(&name) else {
                        reply.set_response_code(ResponseCode::NXDomain);
                        continue;
                    };
                    if q.query_type() != RecordType::A {
                        continue;
                    }
                    let i = {
                        let mut c = counts.lock().unwrap();
                        let count = c.entry(name.clone()).or_insert(0);
                        *count += 1;
                        (*count as usize - 1).min(answers.len() - 1)
                    };
                    let record = Record::from_rdata(
                        q.name().clone(),
                        0,
                        RData::A(hickory_proto::rr::rdata::A(answers[i])),
                    );
                    reply.add_answer(record);
                }
                if let Ok(bytes) = reply.to_vec() {
                    let _ = socket.send_to(&bytes, from).await;
                }
            }
        });
        Self {
            addr,
            queries,
            task,
        }
    }

    /// How many `A` queries `name` got.
    pub fn queries(&self, name: &str) -> u32 {
        let key = format!("{}.", name.trim_end_matches('.'));
        self.queries.lock().unwrap().get(&key).copied().unwrap_or(0)
    }
}

impl std::fmt::Debug for Dns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dns").finish_non_exhaustive()
    }
}

impl Drop for Dns {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The test's loopback addresses: the one a route may reach, and one it may not.
pub const REACHABLE: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);
/// See [`REACHABLE`].
pub const UNREACHABLE: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 3);

/// One `GET path` to `host` at `addr` on a new TCP and TLS connection (HTTP/1.1), as the
/// broker's egress sends it: the status and the body's length.
pub async fn direct_get(
    config: Arc<rustls::ClientConfig>,
    addr: SocketAddr,
    host: &str,
    path: &str,
) -> std::io::Result<(u16, usize)> {
    use http_body_util::Empty;
    let other = |e: &dyn std::fmt::Display| std::io::Error::other(e.to_string());
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let name = rustls::pki_types::ServerName::try_from(host.to_owned()).map_err(|e| other(&e))?;
    let tls = tokio_rustls::TlsConnector::from(config)
        .connect(name, tcp)
        .await?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
            .await
            .map_err(|e| other(&e))?;
    let driving = tokio::spawn(connection);
    let request = hyper::Request::get(path)
        .header("host", host)
        .body(Empty::<Bytes>::new())
        .map_err(|e| other(&e))?;
    let response = sender.send_request(request).await.map_err(|e| other(&e))?;
    let status = response.status().as_u16();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| other(&e))?
        .to_bytes();
    driving.abort();
    Ok((status, body.len()))
}

/// Waits until `addr` accepts a TCP connection (the server is up).
pub async fn wait_listening(addr: SocketAddr) {
    for _ in 0..100 {
        if tokio::net::TcpStream::connect(addr).await.is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{addr} never listened");
}

/// `ip` as an `IpAddr`.
pub fn ip(v4: Ipv4Addr) -> IpAddr {
    IpAddr::V4(v4)
}
