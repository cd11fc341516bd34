//! The adapter on synthetic events: each metric as the events say, the label values a
//! closed set (no channel, speaker or text, whatever the events carry), and the endpoint.

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use roundtable_sandbox::events::{
    BrokerEvent, Event, EventKind, ModelOperation, Refusal, TurnFacts, TurnRecord, WarmEvent,
};
use roundtable_sandbox::protocol::Usage;
use roundtable_sandbox::Budget;
use roundtable_sandbox::{TurnFailure, TurnPhase};
use roundtable_sandbox_metrics::{check_address, Metrics, MetricsError, MetricsServer};

const CHANNEL: &str = "c0ffee12";

/// A turn's facts with its record: `total` ms from admission, `phases` (name, ms), its end.
fn facts(
    total: u64,
    phases: &[(TurnPhase, u64)],
    failure: Option<TurnFailure>,
    warm: bool,
) -> EventKind {
    let mut record = TurnRecord::default();
    record.total = Some(Duration::from_millis(total));
    record.phases = phases
        .iter()
        .map(|(p, ms)| (*p, Duration::from_millis(*ms)))
        .collect();
    record.ended = Some(failure);
    record.warm = warm;
    EventKind::Facts(Box::new(TurnFacts::refused("ann", "hi", record)))
}

fn event(at: Instant, turn: Option<u64>, kind: EventKind) -> Event {
    Event {
        at,
        turn,
        channel: Some(CHANNEL.into()),
        kind,
    }
}

/// One warm turn that queued, made a model call and a tool call, and ended ok; one
/// refused busy; one refused by a budget at admission; the warm pool's events with
/// host texts that quote a guest's channel and words.
fn feed(m: &Metrics) {
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    let e = |ms, turn, kind| m.record(&event(at(ms), turn, kind));
    e(0, None, EventKind::Queued { depth: 1 });
    e(0, None, EventKind::Warm(WarmEvent::Prepared));
    e(10, Some(1), EventKind::Admitted);
    e(10, Some(1), EventKind::Phase(TurnPhase::Preparing));
    e(30, Some(1), EventKind::Phase(TurnPhase::ContainerRunning));
    e(30, Some(1), EventKind::Warm(WarmEvent::Adopted));
    e(40, Some(1), EventKind::Phase(TurnPhase::ModelCall));
    e(
        240,
        Some(1),
        EventKind::Broker(BrokerEvent::ModelCall {
            operation: ModelOperation::Chat,
            status: 200,
            latency: Duration::from_millis(200),
            usage: Some(Usage {
                prompt_tokens: Some(120),
                completion_tokens: Some(30),
                ..Default::default()
            }),
        }),
    );
    e(
        250,
        Some(1),
        EventKind::Broker(BrokerEvent::ToolCall {
            name: "#secret zed: my words".into(),
            mcp: true,
            ok: false,
            latency: Duration::from_millis(5),
        }),
    );
    e(
        260,
        Some(1),
        EventKind::Broker(BrokerEvent::Refused {
            status: 429,
            limit: Refusal::Budget(Budget::SpeakerTokensPerDay),
        }),
    );
    e(
        260,
        Some(1),
        EventKind::Broker(BrokerEvent::Refused {
            status: 999,
            limit: Refusal::Malformed,
        }),
    );
    e(
        1010,
        Some(1),
        EventKind::Ended {
            failure: None,
            warm: true,
        },
    );
    e(1010, Some(1), EventKind::Phase(TurnPhase::TearingDown));
    // The turn's record, as its runner measured it.
    e(
        1100,
        Some(1),
        facts(
            1000,
            &[
                (TurnPhase::Preparing, 20),
                (TurnPhase::ContainerRunning, 10),
                (TurnPhase::ModelCall, 970),
                (TurnPhase::TearingDown, 90),
            ],
            None,
            true,
        ),
    );
    e(1100, Some(1), EventKind::Phase(TurnPhase::Done));
    e(
        1100,
        None,
        EventKind::Ended {
            failure: Some(TurnFailure::Busy),
            warm: false,
        },
    );
    e(1200, Some(2), EventKind::Admitted);
    e(
        1200,
        Some(2),
        EventKind::BudgetRefused {
            budget: Budget::ChannelTokensPerDay,
            mid_turn: false,
        },
    );
    e(
        1200,
        Some(2),
        EventKind::Ended {
            failure: Some(TurnFailure::BudgetExceeded),
            warm: false,
        },
    );
    e(
        1200,
        Some(2),
        facts(0, &[], Some(TurnFailure::BudgetExceeded), false),
    );
    e(1300, None, EventKind::Warm(WarmEvent::Prepared));
    e(
        1300,
        None,
        EventKind::Warm(WarmEvent::FellBack {
            reason: "container roundtable-#secret-zed exited: my words".into(),
        }),
    );
    e(1300, None, EventKind::Warm(WarmEvent::Prepared));
    e(
        1300,
        None,
        EventKind::Warm(WarmEvent::Discarded {
            reason: "#secret zed: my words".into(),
        }),
    );
    e(
        1300,
        None,
        EventKind::Engine {
            op: "create",
            latency: Duration::from_millis(80),
            ok: true,
        },
    );
}

#[test]
fn each_metric_is_what_the_events_say() {
    let m = Metrics::new();
    feed(&m);
    let s = |series: &str| {
        m.sample(series)
            .unwrap_or_else(|| panic!("{series}:\n{}", m.encode()))
    };
    assert_eq!(s("roundtable_turns_total{outcome=\"ok\"}"), 1.0);
    assert_eq!(s("roundtable_turns_total{outcome=\"busy\"}"), 1.0);
    assert_eq!(
        s("roundtable_turns_total{outcome=\"budget_exceeded\"}"),
        1.0
    );
    assert_eq!(
        s("roundtable_turn_duration_seconds_sum{launch_type=\"warm\",outcome=\"ok\"}"),
        1.0
    );
    assert_eq!(
        s("roundtable_turn_duration_seconds_count{launch_type=\"cold\",outcome=\"budget_exceeded\"}"),
        1.0
    );
    assert_eq!(
        s("roundtable_turn_phase_duration_seconds_sum{phase=\"preparing\"}"),
        0.02
    );
    assert_eq!(s("roundtable_queue_depth"), 0.0);
    assert_eq!(s("roundtable_containers_running"), 0.0);
    assert_eq!(s("roundtable_containers_prepared"), 0.0);
    assert_eq!(s("roundtable_warm_adoptions_total"), 1.0);
    assert_eq!(
        s("roundtable_warm_fallbacks_total{reason=\"container_exited\"}"),
        1.0
    );
    assert_eq!(s("roundtable_warm_discards_total{reason=\"other\"}"), 1.0);
    assert_eq!(
        s("roundtable_broker_refusals_total{status=\"429\",limit=\"budget\"}"),
        1.0
    );
    assert_eq!(
        s("roundtable_broker_refusals_total{status=\"0\",limit=\"malformed\"}"),
        1.0
    );
    assert_eq!(
        s("roundtable_tool_calls_total{kind=\"mcp\",outcome=\"error\"}"),
        1.0
    );
    assert_eq!(
        s("roundtable_budget_refusals_total{budget=\"channel_tokens_per_day\",stage=\"admission\"}"),
        1.0
    );
    assert_eq!(
        s("gen_ai_client_operation_duration_seconds_sum{gen_ai_operation_name=\"chat\",roundtable_operation=\"chat\",error_type=\"none\"}"),
        0.2
    );
    assert_eq!(
        s("gen_ai_client_token_usage_sum{gen_ai_operation_name=\"chat\",roundtable_operation=\"chat\",gen_ai_token_type=\"input\"}"),
        120.0
    );
    assert_eq!(
        s("gen_ai_client_token_usage_sum{gen_ai_operation_name=\"chat\",roundtable_operation=\"chat\",gen_ai_token_type=\"output\"}"),
        30.0
    );
    assert_eq!(
        s("roundtable_engine_call_duration_seconds_count{operation=\"create\",outcome=\"ok\"}"),
        1.0
    );
}

#[test]
fn gauges_rise_and_fall_with_the_events() {
    let m = Metrics::new();
    let t = Instant::now();
    m.record(&event(t, None, EventKind::Queued { depth: 1 }));
    m.record(&event(t, None, EventKind::Queued { depth: 2 }));
    m.record(&event(t, None, EventKind::Warm(WarmEvent::Prepared)));
    m.record(&event(t, Some(7), EventKind::Admitted));
    m.record(&event(
        t,
        Some(7),
        EventKind::Phase(TurnPhase::ContainerRunning),
    ));
    assert_eq!(m.sample("roundtable_queue_depth"), Some(1.0));
    assert_eq!(m.sample("roundtable_containers_running"), Some(1.0));
    assert_eq!(m.sample("roundtable_containers_prepared"), Some(1.0));
    // A queued message refused at shutdown leaves the queue.
    m.record(&event(
        t,
        None,
        EventKind::Ended {
            failure: Some(TurnFailure::ShuttingDown),
            warm: false,
        },
    ));
    m.record(&event(
        t,
        Some(7),
        facts(5, &[(TurnPhase::ContainerRunning, 5)], None, false),
    ));
    assert_eq!(m.sample("roundtable_queue_depth"), Some(0.0));
    assert_eq!(m.sample("roundtable_containers_running"), Some(0.0));
}

/// Every label value of the text, `name="value"` pairs.
fn label_values(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((_, rest)) = line.split_once('{') else {
            continue;
        };
        let labels = rest.split_once('}').unwrap().0;
        for pair in labels.split("\",") {
            let (_, v) = pair.split_once("=\"").unwrap();
            out.push(v.trim_end_matches('"').to_owned());
        }
    }
    out
}

#[test]
fn no_label_holds_a_channel_a_speaker_or_text() {
    let m = Metrics::new();
    feed(&m);
    let text = m.encode();
    let values = label_values(&text);
    assert!(values.len() > 40, "{text}");
    for v in &values {
        for bad in [CHANNEL, "#", "secret", "zed", "words", "999"] {
            assert!(!v.contains(bad), "label value {v:?} holds {bad:?}:\n{text}");
        }
    }
}

fn get(addr: std::net::SocketAddr, request: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

#[test]
fn the_endpoint_serves_get_metrics_only_and_on_loopback_unless_allowed() {
    let m = Arc::new(Metrics::new());
    feed(&m);
    let server = MetricsServer::start("127.0.0.1:0".parse().unwrap(), false, m.clone()).unwrap();
    let addr = server.local_addr();
    let ok = get(addr, "GET /metrics HTTP/1.0\r\n\r\n");
    assert!(ok.starts_with("HTTP/1.0 200 OK\r\n"), "{ok}");
    assert!(
        ok.contains("content-type: application/openmetrics-text; version=1.0.0; charset=utf-8"),
        "{ok}"
    );
    assert!(
        ok.contains("roundtable_turns_total{outcome=\"ok\"} 1"),
        "{ok}"
    );
    assert!(ok.trim_end().ends_with("# EOF"), "{ok}");
    let missing = get(addr, "GET /other HTTP/1.0\r\n\r\n");
    assert!(missing.starts_with("HTTP/1.0 404"), "{missing}");
    let post = get(addr, "POST /metrics HTTP/1.0\r\ncontent-length: 0\r\n\r\n");
    assert!(post.starts_with("HTTP/1.0 405"), "{post}");
    assert!(post.contains("allow: GET, HEAD"), "{post}");
    drop(server);
    assert!(std::net::TcpStream::connect(addr).is_err(), "still served");

    let public = "0.0.0.0:0".parse().unwrap();
    let e = MetricsServer::start(public, false, m.clone()).unwrap_err();
    assert!(matches!(e, MetricsError::NotLoopback(_)), "{e:?}");
    assert_eq!(
        e.to_string(),
        "metrics address 0.0.0.0:0 is not a loopback address (give --metrics-allow-remote to serve metrics beyond this host)"
    );
    check_address("[::1]:9464".parse().unwrap(), false).unwrap();
    check_address(public, true).unwrap();
}
