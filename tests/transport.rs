//! The broker's transport seam (issue 14 item 2): a backend whose container is not on
//! this host carries the guest's HTTP over byte streams of its own
//! (`BrokerTransport::Streams`; here the fake driver's relaying mode); the turn serves them
//! with the same broker, bound to the same turn context, and binds no socket. The Docker
//! path (a unix socket in the run dir, peer-checked) is covered by the container suites.

use std::sync::Arc;

use roundtable_sandbox::internals::testing::{self as support, FakeDriver, FnTool};
use roundtable_sandbox::{Sandbox, TurnFailure};

/// Answers with the channel and speaker the broker bound to the call.
fn whoami() -> FnTool {
    FnTool::new("whoami", "who calls", |_, ctx| async move {
        Ok(format!("{} as {}", ctx.channel, ctx.speaker.name))
    })
}

#[tokio::test]
async fn a_backend_carries_the_brokers_http_over_its_own_streams() {
    let env = support::Env::new();
    // Its "guest" reaches the broker only through in-memory duplex pipes: the run opens one,
    // hands the broker its end and speaks HTTP on the other, as a relay would.
    let driver = FakeDriver::relaying();
    let mut config = env.config();
    config.driver = Some(driver.clone());
    config.tools = vec![Arc::new(whoami())];
    let sandbox = Sandbox::new(config).await.unwrap();
    let outcome = sandbox
        .run_turn(support::request("#relay", "/v1/tools/whoami"))
        .await;
    assert_eq!(outcome.failure, None, "{:?}", outcome.reply);
    let answer = outcome.reply.text.clone().unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    // The broker bound the turn's context to the carried stream.
    assert!(answer.contains("#relay as ann"), "{answer}");
    assert!(
        !driver.runs()[0].socket_bound,
        "no unix socket is bound when the backend carries the streams"
    );
    assert!(support::run_root_entries(&env.run_root).is_empty());
}

#[tokio::test]
async fn the_carried_streams_get_the_brokers_refusals() {
    // Speaks to an unknown path: the same 404 as on the socket.
    let env = support::Env::new();
    let mut config = env.config();
    config.driver = Some(FakeDriver::relaying());
    let sandbox = Sandbox::new(config).await.unwrap();
    let outcome = sandbox
        .run_turn(support::request("#relay", "/etc/passwd"))
        .await;
    assert_ne!(outcome.failure, Some(TurnFailure::Internal));
    let answer = outcome.reply.text.clone().unwrap();
    assert!(answer.starts_with("HTTP/1.1 404"), "{answer}");
}
