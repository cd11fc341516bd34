//! `explain` shows the compaction settings, never a key. Needs no Docker: `explain` reads
//! the config file and prints.

mod common;

fn explain(config: &str, env: &[(&str, &str)]) -> (i32, String, String) {
    let (_dir, path) = common::config_in("rte-", "sandbox.toml", |dir| {
        format!(
            "image = \"roundtable-sandbox-guest:latest\"\nrun_root = \"{0}/run\"\n\
             workspace_root = \"{0}/ws\"\nmodel = \"m\"\nmodel_url = \"https://models.invalid/v1\"\n\
             api_key_env = \"RTS_EXPLAIN_MAIN_KEY\"\n{config}",
            dir.display()
        )
    });
    let mut cmd = common::command();
    cmd.arg("explain")
        .arg("--config")
        .arg(&path)
        .env("RTS_EXPLAIN_MAIN_KEY", "sk-explain-main-5150")
        .env_remove("RTS_EXPLAIN_SUM_KEY");
    for (k, v) in env {
        cmd.env(k, v);
    }
    common::outcome(&mut cmd)
}

const SECTION: &str =
    "[compaction]\nurl = \"https://summarizer.invalid/v1\"\nmodel = \"sum-model\"\n\
                       api_key_env = \"RTS_EXPLAIN_SUM_KEY\"\ntimeout_secs = 45\n";

#[test]
fn explain_shows_the_summarizer_and_never_its_key() {
    let (code, out, err) = explain(SECTION, &[("RTS_EXPLAIN_SUM_KEY", "sk-explain-sum-6160")]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains(
            "compaction    summarizer sum-model at summarizer.invalid (https), timeout 45 s, \
             key: set from environment variable RTS_EXPLAIN_SUM_KEY (held by the broker only); \
             fallback: main model, then plain summary"
        ),
        "{out}"
    );
    assert!(!out.contains("sk-explain-sum-6160") && !err.contains("sk-explain-sum-6160"));
    assert!(!out.contains("sk-explain-main-5150"));
}

#[test]
fn explain_refuses_a_missing_summarizer_key_and_shows_the_default() {
    // An unset summarizer key is the same startup error as the model's (issue 44): the
    // config is refused, naming the variable.
    let (code, out, err) = explain(SECTION, &[]);
    assert_ne!(code, 0, "{out}{err}");
    assert!(
        err.contains("read api key: environment variable RTS_EXPLAIN_SUM_KEY is not set"),
        "{out}{err}"
    );
    let (code, out, err) = explain("", &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains(
            "compaction    through the main model (no [compaction] section); fallback: plain summary"
        ),
        "{out}"
    );
}
