//! The broker's transport seam (issue 14 item 2): a backend whose container is not on
//! this host carries the guest's HTTP over byte streams of its own
//! ([`BrokerTransport::Streams`]); the turn serves them with the same broker, bound to the
//! same turn context, and binds no socket. The Docker path (a unix socket in the run dir,
//! peer-checked) is covered by the container suites.

use std::sync::{Arc, Mutex};

use roundtable_sandbox::broker::BoxFuture;
use roundtable_sandbox::driver::{
    BrokerTransport, ContainerSpec, DriverError, GuestStream, SweepScope,
};
use roundtable_sandbox::testing as support;
use roundtable_sandbox::{
    ContainerDriver, HostTool, Reply, RunOutcome, Sandbox, ToolCallContext, TurnFailure,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// A backend that reaches its "guest" only through in-memory duplex pipes: each run opens
/// one, hands the broker its end and speaks HTTP on the other, as a relay would.
#[derive(Debug, Default)]
struct RelayDriver {
    relay: Mutex<Option<mpsc::Sender<Box<dyn GuestStream>>>>,
    /// Whether a socket file existed in the run dir during the run.
    socket_seen: Mutex<Option<bool>>,
}

impl ContainerDriver for RelayDriver {
    fn broker_transport<'a>(
        &'a self,
        _spec: &'a ContainerSpec,
    ) -> BoxFuture<'a, Result<BrokerTransport, DriverError>> {
        let (tx, rx) = mpsc::channel(4);
        *self.relay.lock().unwrap() = Some(tx);
        Box::pin(async { Ok(BrokerTransport::Streams(rx)) })
    }

    fn run<'a>(
        &'a self,
        spec: &'a ContainerSpec,
        _stdin: &'a [u8],
        _cancel: CancellationToken,
    ) -> BoxFuture<'a, Result<RunOutcome, DriverError>> {
        Box::pin(async move {
            *self.socket_seen.lock().unwrap() = Some(spec.run_dir.join("broker.sock").exists());
            let relay = self
                .relay
                .lock()
                .unwrap()
                .take()
                .expect("transport asked first");
            let (guest, host) = tokio::io::duplex(64 * 1024);
            relay.send(Box::new(host)).await.expect("broker serving");
            let answer = http_post(guest, "/v1/tools/whoami", "{}").await;
            Ok(RunOutcome::replied(&Reply::text(
                answer,
                Default::default(),
            )))
        })
    }

    fn remove<'a>(&'a self, _name: &'a str) -> BoxFuture<'a, Result<(), DriverError>> {
        Box::pin(async { Ok(()) })
    }

    fn sweep<'a>(
        &'a self,
        _scope: SweepScope<'a>,
    ) -> BoxFuture<'a, Result<Vec<String>, DriverError>> {
        Box::pin(async { Ok(Vec::new()) })
    }
}

/// One HTTP/1.1 request on `stream`; the whole answer (head and body) as text.
async fn http_post(mut stream: impl GuestStream, path: &str, body: &str) -> String {
    let request = format!(
        "POST {path} HTTP/1.1\r\nhost: broker\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.unwrap();
    String::from_utf8_lossy(&answer).into_owned()
}

/// Answers with the channel and speaker the broker bound to the call.
#[derive(Debug)]
struct WhoAmI;

impl HostTool for WhoAmI {
    fn name(&self) -> &str {
        "whoami"
    }
    fn description(&self) -> &str {
        "who calls"
    }
    fn parameters(&self) -> serde_json::Value {
        serde_json::json!({"type": "object"})
    }
    fn call(
        &self,
        _: serde_json::Value,
        ctx: ToolCallContext,
    ) -> BoxFuture<'_, Result<String, String>> {
        Box::pin(async move { Ok(format!("{} as {}", ctx.channel, ctx.speaker.name)) })
    }
}

#[tokio::test]
async fn a_backend_carries_the_brokers_http_over_its_own_streams() {
    let env = support::Env::new();
    let driver = Arc::new(RelayDriver::default());
    let mut config = env.config();
    config.driver = Some(driver.clone());
    config.tools = vec![Arc::new(WhoAmI)];
    let sandbox = Sandbox::new(config).await.unwrap();
    let outcome = sandbox
        .run_turn_outcome(support::request("#relay", "hi"))
        .await;
    assert_eq!(outcome.failure, None, "{:?}", outcome.reply);
    let answer = outcome.reply.text.clone().unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    // The broker bound the turn's context to the carried stream.
    assert!(answer.contains("#relay as ann"), "{answer}");
    assert_eq!(
        *driver.socket_seen.lock().unwrap(),
        Some(false),
        "no unix socket is bound when the backend carries the streams"
    );
    assert!(support::run_root_entries(&env.run_root).is_empty());
}

#[tokio::test]
async fn the_carried_streams_get_the_brokers_refusals() {
    /// Speaks to an unknown path: the same 404 as on the socket.
    #[derive(Debug, Default)]
    struct Lost(RelayDriver);
    impl ContainerDriver for Lost {
        fn broker_transport<'a>(
            &'a self,
            spec: &'a ContainerSpec,
        ) -> BoxFuture<'a, Result<BrokerTransport, DriverError>> {
            self.0.broker_transport(spec)
        }
        fn run<'a>(
            &'a self,
            _spec: &'a ContainerSpec,
            _stdin: &'a [u8],
            _cancel: CancellationToken,
        ) -> BoxFuture<'a, Result<RunOutcome, DriverError>> {
            Box::pin(async move {
                let relay = self.0.relay.lock().unwrap().take().unwrap();
                let (guest, host) = tokio::io::duplex(64 * 1024);
                relay.send(Box::new(host)).await.unwrap();
                let answer = http_post(guest, "/etc/passwd", "").await;
                Ok(RunOutcome::replied(&Reply::text(
                    answer,
                    Default::default(),
                )))
            })
        }
        fn remove<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), DriverError>> {
            self.0.remove(name)
        }
        fn sweep<'a>(
            &'a self,
            scope: SweepScope<'a>,
        ) -> BoxFuture<'a, Result<Vec<String>, DriverError>> {
            self.0.sweep(scope)
        }
    }
    let env = support::Env::new();
    let mut config = env.config();
    config.driver = Some(Arc::new(Lost::default()));
    let sandbox = Sandbox::new(config).await.unwrap();
    let outcome = sandbox
        .run_turn_outcome(support::request("#relay", "hi"))
        .await;
    assert_ne!(outcome.failure, Some(TurnFailure::Internal));
    let answer = outcome.reply.text.clone().unwrap();
    assert!(answer.starts_with("HTTP/1.1 404"), "{answer}");
}
