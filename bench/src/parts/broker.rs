//! Part 3, the broker: a model call through the broker against the same call straight to
//! the scripted model, interleaved: the round trip, the first streamed event and the whole
//! stream; then the requests/s of 8 concurrent guest-style callers on each path.

use anyhow::{Context, Result};
use serde::Serialize;

use crate::harness::broker::{self as harness, BrokerUnderTest, Model, Target};
use crate::stats::{round3, round3_all, Samples, Summary};
use crate::Options;

/// A figure through the broker and direct.
#[derive(Debug, Serialize)]
pub struct BrokerDirect {
    pub broker: Summary,
    pub direct: Summary,
}

/// The requests/s of `workers` callers, by run.
#[derive(Debug, Serialize)]
pub struct Rps {
    pub workers: usize,
    pub calls_per_worker: usize,
    pub broker: Vec<f64>,
    pub direct: Vec<f64>,
    pub broker_best: f64,
    pub direct_best: f64,
}

/// Part 3's figures.
#[derive(Debug, Serialize)]
pub struct BrokerPart {
    pub round_trip: BrokerDirect,
    pub first_streamed_event: BrokerDirect,
    pub whole_stream: BrokerDirect,
    /// What the broker adds to a round trip (p50; the target's).
    pub added_p50_ms: f64,
    pub added_p95_ms: f64,
    pub added_first_event_p50_ms: f64,
    pub rps: Rps,
}

pub async fn run(o: &Options, model: &Model) -> Result<BrokerPart> {
    println!(
        "\n== 3. broker: a model call through the broker vs straight to the scripted model, {} interleaved calls each",
        o.broker_calls
    );
    let mut b = BrokerUnderTest::start(&model.url()).await?;
    let direct = Target::Direct(model.addr);
    let plain = harness::chat_body(false);
    let streamed = harness::chat_body(true);

    // Round trips (non-streamed) and first streamed event, interleaved.
    let mut rt_b = Samples::default();
    let mut rt_d = Samples::default();
    let mut fe_b = Samples::default();
    let mut fe_d = Samples::default();
    let mut st_b = Samples::default();
    let mut st_d = Samples::default();
    let mut calls = 0usize;
    for i in 0..(o.broker_calls + 50) {
        if calls + 4 > 9_000 {
            b.relisten().await?;
            calls = 0;
        }
        let via = Target::Broker(b.socket());
        let warm = i < 50;
        let order: [&Target; 2] = if i % 2 == 0 {
            [&via, &direct]
        } else {
            [&direct, &via]
        };
        for t in order {
            let plain_t = harness::call(t, &plain, false).await?;
            let stream_t = harness::call(t, &streamed, true).await?;
            calls += 2;
            if warm {
                continue;
            }
            let (rt, fe, st) = match t {
                Target::Broker(_) => (&mut rt_b, &mut fe_b, &mut st_b),
                Target::Direct(_) => (&mut rt_d, &mut fe_d, &mut st_d),
            };
            rt.push(plain_t.total);
            fe.push(stream_t.first_event.context("no event")?);
            st.push(stream_t.total);
        }
    }
    println!(
        "{:<30} {:>10} {:>10} {:>10} {:>10}",
        "(ms)", "broker p50", "direct p50", "broker p95", "direct p95"
    );
    for (name, bs, ds) in [
        ("round trip", &rt_b, &rt_d),
        ("first streamed event", &fe_b, &fe_d),
        ("whole stream", &st_b, &st_d),
    ] {
        println!(
            "{:<30} {:>10.3} {:>10.3} {:>10.3} {:>10.3}",
            name,
            bs.p50(),
            ds.p50(),
            bs.p95(),
            ds.p95()
        );
    }
    let added = rt_b.p50() - rt_d.p50();
    let added_fe = fe_b.p50() - fe_d.p50();
    println!(
        "broker-added p50: round trip {:.3} ms, first streamed event {:.3} ms",
        added, added_fe
    );

    // Throughput: 8 concurrent guest-style callers, alternating paths.
    let (workers, per) = (8usize, (o.broker_calls / 4).max(25));
    let mut rps_b = Vec::new();
    let mut rps_d = Vec::new();
    for k in 0..4 {
        b.relisten().await?;
        let via = Target::Broker(b.socket());
        if k % 2 == 0 {
            rps_b.push(harness::throughput(&via, workers, per).await?);
            rps_d.push(harness::throughput(&direct, workers, per).await?);
        } else {
            rps_d.push(harness::throughput(&direct, workers, per).await?);
            rps_b.push(harness::throughput(&via, workers, per).await?);
        }
    }
    let best = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
    println!(
        "requests/s with {workers} concurrent callers (best of {}): broker {:.0}, direct {:.0} ({:.2}×)",
        rps_b.len(),
        best(&rps_b),
        best(&rps_d),
        best(&rps_b) / best(&rps_d)
    );
    let pair = |b: &Samples, d: &Samples| BrokerDirect {
        broker: b.summary(),
        direct: d.summary(),
    };
    Ok(BrokerPart {
        round_trip: pair(&rt_b, &rt_d),
        first_streamed_event: pair(&fe_b, &fe_d),
        whole_stream: pair(&st_b, &st_d),
        added_p50_ms: round3(added),
        added_p95_ms: round3(rt_b.p95() - rt_d.p95()),
        added_first_event_p50_ms: round3(added_fe),
        rps: Rps {
            workers,
            calls_per_worker: per,
            broker_best: round3(best(&rps_b)),
            direct_best: round3(best(&rps_d)),
            broker: round3_all(&rps_b),
            direct: round3_all(&rps_d),
        },
    })
}
