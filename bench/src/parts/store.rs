//! Part 11 (issue 47), the budgets' PostgreSQL store against the SQLite file, same run
//! (`--only store`, not run by default): warm turns of three runtimes interleaved (SQLite,
//! PostgreSQL, and a second SQLite one, the A/A control), each with every budget set far
//! from reached; then part 8's broker rounds with a SQLite book, a PostgreSQL book and a
//! second SQLite one (the control). The PostgreSQL server runs here, on loopback, as this
//! user, with `fsync` on (as the SQLite file's `synchronous = FULL`). The PostgreSQL
//! store's statements and round trips are counted per commit interval and per turn.

use std::time::Instant;

use anyhow::{Context, Result};
use roundtable_sandbox::internals::budgets::{BudgetBook, COMMIT_INTERVAL};
use roundtable_sandbox_test_support::postgres::Postgres;
use serde::Serialize;

use super::accounting::{broker_rounds, RoundsReport};
use crate::harness::broker::{BrokerUnderTest, Model};
use crate::harness::lifecycle;
use crate::stats::{self, ci95, interval, round3, Samples, Summary};
use crate::Options;

/// The warm reply of the three runtimes.
#[derive(Debug, Serialize)]
pub struct StoreSides {
    pub sqlite: Summary,
    pub postgres: Summary,
    pub control: Summary,
}

/// The PostgreSQL store's statements and round trips (per commit interval or per turn).
#[derive(Debug, Serialize)]
pub struct PgCounts {
    pub statements: f64,
    pub round_trips: f64,
}

/// Part 11's figures.
#[derive(Debug, Serialize)]
pub struct Store {
    pub warm_reply: StoreSides,
    pub warm_reply_pg_vs_sqlite_p50: f64,
    pub warm_reply_pg_vs_sqlite_p50_ci95: Option<[f64; 2]>,
    /// The A/A control: the second SQLite runtime / the first.
    pub warm_reply_control_p50: f64,
    pub warm_reply_control_p50_ci95: Option<[f64; 2]>,
    pub pg_per_interval_warm: PgCounts,
    pub pg_per_turn: PgCounts,
    pub pg_turn_rate: f64,
    pub pg_per_interval_broker: PgCounts,
    /// The broker rounds: off = SQLite book, on = PostgreSQL book, control = a second
    /// SQLite book.
    pub broker: RoundsReport,
}

pub async fn run(o: &Options, model: &Model) -> Result<Store> {
    println!(
        "\n== 11. budgets: PostgreSQL store vs SQLite file: {} warm turns a side and {} broker rounds",
        o.iterations, o.broker_rounds
    );
    let pg = tokio::task::spawn_blocking(Postgres::start).await?;
    pg.create_db("bench");
    let dir = tempfile::Builder::new()
        .prefix("rtb-store-")
        .tempdir_in(lifecycle::bench_dir())?;
    let url_file = dir.path().join("budgets-url");
    std::fs::write(&url_file, pg.url("bench"))?;
    let roots = [
        lifecycle::Roots::new()?,
        lifecycle::Roots::new()?,
        lifecycle::Roots::new()?,
    ];
    let sides = [
        lifecycle::budget_store_sandbox(
            &o.image,
            &roots[0],
            &model.url(),
            &dir.path().join("a.sqlite"),
            None,
            "a",
        )
        .await?,
        lifecycle::budget_store_sandbox(
            &o.image,
            &roots[1],
            &model.url(),
            &dir.path().join("b.sqlite"),
            Some(&url_file),
            "bench",
        )
        .await?,
        lifecycle::budget_store_sandbox(
            &o.image,
            &roots[2],
            &model.url(),
            &dir.path().join("c.sqlite"),
            None,
            "c",
        )
        .await?,
    ];
    let stats = sides[1]
        .budgets()
        .and_then(|b| b.store_stats())
        .context("the PostgreSQL side's store")?;
    let mut reply: [Samples; 3] = Default::default();
    let count = |s: &roundtable_sandbox::internals::budgets::PgStats| {
        use std::sync::atomic::Ordering::Relaxed;
        (s.statements.load(Relaxed), s.round_trips.load(Relaxed))
    };
    let mut measured = (count(&stats), Instant::now(), 0usize);
    for i in 0..(o.iterations + o.warmup) {
        if i == o.warmup {
            measured = (count(&stats), Instant::now(), 0);
        }
        let channel = format!("#bench-{}", i % 8);
        // The three in a rotating order.
        for k in 0..3 {
            let side = (i + k) % 3;
            let (t, _) = lifecycle::warm_turn(&sides[side], &channel).await?;
            if i >= o.warmup {
                reply[side].push(t.reply);
                if side == 1 {
                    measured.2 += 1;
                }
            }
        }
    }
    let ((st0, rt0), t0, turns) = measured;
    let (st1, rt1) = count(&stats);
    let secs = t0.elapsed().as_secs_f64();
    let intervals = secs / COMMIT_INTERVAL.as_secs_f64();
    for s in &sides {
        s.shutdown().await;
    }
    drop(sides);
    let ratio_pg = reply[1].p50() / reply[0].p50();
    let ci_pg = stats::paired_p50_ratio_ci(&reply[1], &reply[0]);
    let ratio_aa = reply[2].p50() / reply[0].p50();
    let ci_aa = stats::paired_p50_ratio_ci(&reply[2], &reply[0]);
    let (st, rt) = ((st1 - st0) as f64, (rt1 - rt0) as f64);
    println!(
        "warm reply p50: SQLite {:.2} ms, PostgreSQL {:.2} ms: {ratio_pg:.3}× (95 % interval {}); \
         A/A control (a second SQLite runtime / the first): {ratio_aa:.3}× ({})",
        reply[0].p50(),
        reply[1].p50(),
        interval(ci_pg),
        interval(ci_aa),
    );
    println!(
        "  PostgreSQL store during the warm turns ({turns} turns of its side in {secs:.1} s, {:.2} turns/s of it, \
         {:.2} turns/s in all): {:.2} statements and {:.2} round trips per commit interval, {:.2} statements \
         and {:.2} round trips per turn",
        turns as f64 / secs,
        3.0 * turns as f64 / secs,
        st / intervals,
        rt / intervals,
        st / turns.max(1) as f64,
        rt / turns.max(1) as f64,
    );
    // The broker: three books, one broker each.
    let settings = |file: &str, store: bool| roundtable_sandbox::BudgetSettings {
        state_file: Some(dir.path().join(file)),
        speaker_tokens_per_day: Some(1_000_000_000_000),
        channel_tokens_per_day: Some(1_000_000_000_000),
        bot_tokens_per_day: Some(1_000_000_000_000),
        store: store.then(|| {
            roundtable_sandbox::StoreSource::Ref(roundtable_sandbox::KeyRef {
                env: None,
                file: Some(url_file.clone()),
            })
        }),
        namespace: store.then(|| "broker".to_owned()),
        ..Default::default()
    };
    let books = [
        BudgetBook::open(&settings("ba.sqlite", false), "UTC")?.context("book")?,
        BudgetBook::open(&settings("bb.sqlite", true), "UTC")?.context("book")?,
        BudgetBook::open(&settings("bc.sqlite", false), "UTC")?.context("book")?,
    ];
    let bstats = books[1].store_stats().context("the broker's store")?;
    let mut brokers = [
        BrokerUnderTest::start_observed(&model.url(), Some(books[0].clone()), None, None).await?,
        BrokerUnderTest::start_observed(&model.url(), Some(books[1].clone()), None, None).await?,
        BrokerUnderTest::start_observed(&model.url(), Some(books[2].clone()), None, None).await?,
    ];
    let (b0, bt0) = (count(&bstats), Instant::now());
    let rounds = broker_rounds(&mut brokers, o.broker_rounds, 8, 1_200, 1).await?;
    let (b1, bsecs) = (count(&bstats), bt0.elapsed().as_secs_f64());
    println!("  (broker: off = SQLite book, on = PostgreSQL book, control = a second SQLite book)");
    let broker = rounds.report("8 callers in one turn, SQLite vs PostgreSQL book");
    let calls = (o.broker_rounds * 8 * 1_200 * 3) as f64;
    let pg_calls = calls / 3.0;
    let bintervals = bsecs / COMMIT_INTERVAL.as_secs_f64();
    println!(
        "  PostgreSQL store during the broker rounds ({pg_calls:.0} calls of its broker in {bsecs:.1} s): \
         {:.2} statements and {:.2} round trips per commit interval",
        (b1.0 - b0.0) as f64 / bintervals,
        (b1.1 - b0.1) as f64 / bintervals,
    );
    drop(brokers);
    drop(books);
    Ok(Store {
        warm_reply: StoreSides {
            sqlite: reply[0].summary(),
            postgres: reply[1].summary(),
            control: reply[2].summary(),
        },
        warm_reply_pg_vs_sqlite_p50: round3(ratio_pg),
        warm_reply_pg_vs_sqlite_p50_ci95: ci95(ci_pg),
        warm_reply_control_p50: round3(ratio_aa),
        warm_reply_control_p50_ci95: ci95(ci_aa),
        pg_per_interval_warm: PgCounts {
            statements: round3(st / intervals),
            round_trips: round3(rt / intervals),
        },
        pg_per_turn: PgCounts {
            statements: round3(st / turns.max(1) as f64),
            round_trips: round3(rt / turns.max(1) as f64),
        },
        pg_turn_rate: round3(turns as f64 / secs),
        pg_per_interval_broker: PgCounts {
            statements: round3((b1.0 - b0.0) as f64 / bintervals),
            round_trips: round3((b1.1 - b0.1) as f64 / bintervals),
        },
        broker,
    })
}
