//! The network side of an egress request, which is the broker's to guard: the host
//! resolved by the broker itself ([`Resolver`], a seam the tests point at a loopback DNS
//! server), every address it got checked against the deny set ([`denied`]: loopback,
//! private, link-local and the metadata address, CGNAT, multicast, reserved and
//! documentation ranges, their IPv6 forms, IPv4-mapped and NAT64 addresses judged by the
//! IPv4 address inside, and the engine's own bridge networks) unless the route names the
//! range in `allow_private`, and the connection made to the address checked (no second
//! lookup: DNS rebinding cannot change where it goes), over TLS (rustls: the web's roots and
//! the route's own CA), HTTP/1.1 with hyper, nothing decompressed, no redirect followed
//! here, the answer's body read through the bounded reader.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::HeaderMap;
use hyper_util::rt::TokioIo;

use crate::config::Cidr;

/// The deny set's reason for `ip`, or `None` when it is a public address. `engine` are the
/// container engine's own networks.
pub(crate) fn denied(ip: IpAddr, engine: &[Cidr]) -> Option<&'static str> {
    // An IPv4-mapped address is its IPv4 address to a dual-stack socket: checked as that
    // too (an IPv4 engine range never matched its IPv6 form).
    let mapped = match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4),
        IpAddr::V4(_) => None,
    };
    if engine
        .iter()
        .any(|c| c.contains(ip) || mapped.is_some_and(|m| c.contains(m)))
    {
        return Some("an address of the container engine's own networks");
    }
    match ip {
        IpAddr::V4(v4) => denied_v4(v4),
        IpAddr::V6(v6) => denied_v6(v6),
    }
}

fn denied_v4(ip: Ipv4Addr) -> Option<&'static str> {
    let [a, b, c, _] = ip.octets();
    Some(match (a, b, c) {
        (0, _, _) => "the 0.0.0.0/8 network",
        (10, _, _) => "a private address (10.0.0.0/8)",
        (100, 64..=127, _) => "a shared (CGNAT) address",
        (127, _, _) => "a loopback address",
        (169, 254, _) => "a link-local address (the metadata service among them)",
        (172, 16..=31, _) => "a private address (172.16.0.0/12)",
        (192, 0, 0) => "an IETF protocol address",
        (192, 0, 2) | (198, 51, 100) | (203, 0, 113) => "a documentation address",
        (192, 88, 99) => "a 6to4 relay address",
        (192, 168, _) => "a private address (192.168.0.0/16)",
        (198, 18..=19, _) => "a benchmarking address",
        (224..=239, _, _) => "a multicast address",
        (240..=255, _, _) => "a reserved address",
        _ => return None,
    })
}

fn denied_v6(ip: Ipv6Addr) -> Option<&'static str> {
    if let Some(v4) = ip.to_ipv4_mapped() {
        return denied_v4(v4);
    }
    let s = ip.segments();
    // NAT64 (64:ff9b::/96 and the local 64:ff9b:1::/48): the IPv4 address inside.
    if s[0] == 0x64 && s[1] == 0xff9b && (s[2..6] == [0; 4] || s[2] == 1) {
        let v4 = Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8);
        return denied_v4(v4).or(Some("a NAT64 address"));
    }
    Some(match s[0] {
        _ if ip.is_unspecified() => "the unspecified address",
        _ if ip.is_loopback() => "a loopback address",
        0 => "an IPv4-compatible or reserved address",
        0x100 if s[1..4] == [0; 3] => "a discard address",
        0x2001 if s[1] < 0x200 => "an IETF special address (Teredo among them)",
        0x2001 if s[1] == 0xdb8 => "a documentation address",
        0x2002 => "a 6to4 address",
        0xfc00..=0xfdff => "a unique-local address",
        0xfe80..=0xfebf => "a link-local address",
        0xfec0..=0xfeff => "a site-local address",
        0xff00..=0xffff => "a multicast address",
        _ => return None,
    })
}

/// Resolves a host name to its addresses: one lookup per request.
pub(crate) struct Resolver(hickory_resolver::TokioResolver);

impl Resolver {
    /// The system's resolver (`/etc/resolv.conf`), or the name server at `nameserver`
    /// (UDP and TCP) when given. Nothing is cached: every request looks its host up.
    pub(crate) fn new(nameserver: Option<SocketAddr>) -> Result<Self, String> {
        use hickory_resolver::config::{NameServerConfigGroup, ResolverConfig};
        use hickory_resolver::name_server::TokioConnectionProvider;
        let builder = match nameserver {
            Some(addr) => {
                let group = NameServerConfigGroup::from_ips_clear(&[addr.ip()], addr.port(), true);
                hickory_resolver::Resolver::builder_with_config(
                    ResolverConfig::from_parts(None, vec![], group),
                    TokioConnectionProvider::default(),
                )
            }
            None => hickory_resolver::Resolver::builder_tokio()
                .map_err(|e| format!("read the system's resolver config: {e}"))?,
        };
        let mut builder = builder;
        let opts = builder.options_mut();
        opts.cache_size = 0;
        opts.attempts = 1;
        opts.timeout = Duration::from_secs(3);
        Ok(Self(builder.build()))
    }

    /// Every address of `host`.
    pub(crate) async fn lookup(&self, host: &str) -> Result<Vec<IpAddr>, String> {
        // The resolver's own words stay on the host: they name the names it tried (the
        // host's search domains) and the servers it asked.
        let found = self.0.lookup_ip(host).await.map_err(|e| {
            tracing::debug!(error = %e, "an egress name did not resolve");
            format!("the name {host} does not resolve")
        })?;
        Ok(found.iter().collect())
    }
}

/// The TLS settings of a route: the web's roots and its own CA, HTTP/1.1.
pub(crate) fn tls_config(
    ca_file: Option<&std::path::Path>,
) -> Result<Arc<rustls::ClientConfig>, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;
    let mut roots = rustls::RootCertStore {
        roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
    };
    if let Some(path) = ca_file {
        let certs = CertificateDer::pem_file_iter(path)
            .map_err(|e| format!("read ca_file {}: {e}", path.display()))?;
        let mut added = 0;
        for cert in certs {
            let cert = cert.map_err(|e| format!("read ca_file {}: {e}", path.display()))?;
            roots
                .add(cert)
                .map_err(|e| format!("ca_file {}: {e}", path.display()))?;
            added += 1;
        }
        if added == 0 {
            return Err(format!("ca_file {} holds no certificate", path.display()));
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The most an answer's head (status line and headers) may take, bytes: past it the
/// exchange fails (`502`). (hyper's own default is about 400 KiB, which the turn's bytes in
/// would count only after it was read.)
pub(crate) const MAX_HEAD_BYTES: usize = 64 * 1024;

/// The bytes of `headers` as sent (name, value, `: ` and CR LF each).
pub(crate) fn head_bytes(headers: &HeaderMap) -> usize {
    headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len() + 4)
        .sum()
}

/// A request ready to send to the address checked.
pub(crate) struct Outgoing {
    pub(crate) addr: SocketAddr,
    pub(crate) host: String,
    pub(crate) method: hyper::Method,
    /// Path and query, origin-form.
    pub(crate) path_and_query: String,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
}

/// What came back: the head and the body (at most the cap).
pub(crate) struct Incoming {
    pub(crate) status: hyper::StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Vec<u8>,
}

/// Why an exchange failed.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The TCP or TLS connection was not made.
    Connect(String),
    /// The exchange failed after it.
    Exchange(String),
    /// The body passed the cap.
    TooLarge(usize),
    /// The head passed [`MAX_HEAD_BYTES`].
    HeadTooLarge,
    /// What was read passed what the turn may still read on the route.
    TurnSpent,
}

/// Connects to `out.addr` (within `connect`), speaks TLS to `out.host` and HTTP/1.1, and
/// reads the answer's body up to `cap` bytes. Each part read (the head, then each frame of
/// the body) is passed to `charge` as it arrives, which counts it and says whether it still
/// fits what the turn may read: concurrent requests share that as they read, and a failed
/// exchange has counted what it read. The caller bounds the whole by its deadline.
pub(crate) async fn exchange(
    out: Outgoing,
    tls: Arc<rustls::ClientConfig>,
    connect: Duration,
    cap: usize,
    charge: &mut (dyn FnMut(u64) -> bool + Send),
) -> Result<Incoming, Failure> {
    let name = rustls::pki_types::ServerName::try_from(out.host.clone())
        .map_err(|_| Failure::Connect(format!("{} is no TLS server name", out.host)))?;
    let stream = async {
        let tcp = tokio::net::TcpStream::connect(out.addr)
            .await
            .map_err(|e| format!("connect to {}: {e}", out.addr))?;
        tcp.set_nodelay(true).ok();
        tokio_rustls::TlsConnector::from(tls)
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS with {}: {e}", out.host))
    };
    let stream = tokio::time::timeout(connect, stream)
        .await
        .map_err(|_| Failure::Connect(format!("no connection within {connect:?}")))?
        .map_err(Failure::Connect)?;
    let (mut sender, connection) = hyper::client::conn::http1::Builder::new()
        .max_buf_size(MAX_HEAD_BYTES)
        .handshake(TokioIo::new(stream))
        .await
        .map_err(|e| Failure::Exchange(format!("HTTP handshake: {e}")))?;
    let driver = tokio::spawn(async move {
        let _ = connection.await;
    });
    let mut request = hyper::Request::builder()
        .method(out.method)
        .uri(out.path_and_query)
        .body(Full::new(out.body))
        .map_err(|e| Failure::Exchange(format!("build the request: {e}")))?;
    *request.headers_mut() = out.headers;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| Failure::Exchange(format!("the upstream did not answer: {e}")))?;
    let (head, mut body) = response.into_parts();
    // hyper stops reading a head at about `max_buf_size` and one read more: the exact
    // bound is checked here, on what it parsed.
    let head_size = head_bytes(&head.headers);
    if head_size > MAX_HEAD_BYTES {
        driver.abort();
        charge(head_size as u64);
        return Err(Failure::HeadTooLarge);
    }
    if !charge(head_size as u64) {
        driver.abort();
        return Err(Failure::TurnSpent);
    }
    let mut bytes = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| Failure::Exchange(format!("read the answer: {e}")))?;
        if let Ok(data) = frame.into_data() {
            let fits = charge(data.len() as u64);
            if bytes.len() + data.len() > cap {
                driver.abort();
                return Err(Failure::TooLarge(cap));
            }
            if !fits {
                driver.abort();
                return Err(Failure::TurnSpent);
            }
            bytes.extend_from_slice(&data);
        }
    }
    driver.abort();
    Ok(Incoming {
        status: head.status,
        headers: head.headers,
        body: bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verdict(ip: &str) -> Option<&'static str> {
        denied(ip.parse().unwrap(), &[])
    }

    #[test]
    fn the_deny_set() {
        for ip in [
            "127.0.0.2",
            "10.1.2.3",
            "172.31.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "224.0.0.1",
            "240.0.0.1",
            "255.255.255.255",
            "192.0.2.1",
            "::1",
            "::",
            "fd00::1",
            "fe80::1",
            "ff02::1",
            "::ffff:127.0.0.1",
            "::ffff:10.0.0.1",
            "64:ff9b::a9fe:a9fe",
            "2001:db8::1",
            "2002::1",
        ] {
            assert!(verdict(ip).is_some(), "{ip} passes");
        }
        for ip in [
            "93.184.216.34",
            "1.1.1.1",
            "2606:4700::1111",
            "::ffff:8.8.8.8",
        ] {
            assert_eq!(verdict(ip), None, "{ip} is refused");
        }
        let engine = [Cidr::parse("203.1.0.0/16").unwrap()];
        assert!(denied("203.1.2.3".parse().unwrap(), &engine).is_some());
        // Its IPv4-mapped form is the same address to a dual-stack socket.
        assert!(denied("::ffff:203.1.2.3".parse().unwrap(), &engine).is_some());
    }
}
