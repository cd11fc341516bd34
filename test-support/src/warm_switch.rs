//! The security suite through prepared containers: with `ROUNDTABLE_WARM=1` every turn of
//! a test that uses this [`Sandbox`] runs in a container prepared before its message (see
//! `roundtable_sandbox::internals::warm`), and the test fails if the turn did not adopt it; unset, it
//! is the plain runtime. scripts/test.sh runs the hostile suite both ways.

use roundtable_sandbox::{Config, Reply, SandboxError, TurnRequest};
use tokio_util::sync::CancellationToken;

/// Whether this run's turns go through prepared containers.
pub fn warm() -> bool {
    std::env::var("ROUNDTABLE_WARM").is_ok_and(|v| v == "1")
}

/// The runtime, with its turns warm when [`warm`] says so.
#[derive(Debug, Clone)]
pub struct Sandbox(roundtable_sandbox::Sandbox);

impl std::ops::Deref for Sandbox {
    type Target = roundtable_sandbox::Sandbox;
    fn deref(&self) -> &roundtable_sandbox::Sandbox {
        &self.0
    }
}

impl Sandbox {
    pub async fn new(mut config: Config) -> Result<Self, SandboxError> {
        if warm() {
            config.warm.enabled = true;
        }
        roundtable_sandbox::Sandbox::new(config).await.map(Self)
    }

    /// Runs the turn; warm: in a container prepared for it first, never replaced by a cold one.
    pub async fn run_turn(&self, request: TurnRequest) -> Reply {
        if !warm() {
            return self.0.run_turn(request).await.reply;
        }
        let prepared = self
            .0
            .prepare_turn(&request.channel, CancellationToken::new())
            .await
            .expect("prepare the turn's container")
            .expect("a container is prepared");
        let (_, cold) = self.0.warm_counts();
        let turn = self.0.admit(request);
        let reply = self.0.run(turn, Some(prepared), |_| {}).await.reply;
        // Adopted, or refused before adoption (a quota refusal, as on the cold path):
        // never replaced by a cold start.
        assert_eq!(
            self.0.warm_counts().1,
            cold,
            "the prepared container could not serve the turn"
        );
        reply
    }
}
