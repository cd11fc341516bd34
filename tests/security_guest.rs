//! Hostile guests against the sealed container. Each test is one attack, run by a guest
//! built to attack (the hostile image of scripts/build-hostile-image.sh: a static attack
//! program, a setuid-root bait, busybox). Each attack must fail, the turn must end with a
//! clear reply, and nothing may be left behind (no container, run dir or socket).
//! docs/security.md maps each control to its test here.

use roundtable_sandbox::internals::testing::DockerDriverExt;
use std::time::{Duration, Instant};

use roundtable_sandbox::internals::testing::*;
use roundtable_sandbox::ApiKey;
use roundtable_sandbox_test_support::hostile;
use roundtable_sandbox_test_support::model::{ScriptedModel, Step};
use roundtable_sandbox_test_support::warm_switch::Sandbox;

const KEY: &str = "sk-sec-otter-9191-never-inside";

/// Prints `{"ok":true,"text":"<out>"}` after `body`, `out` being what `body` set.
fn reply_after(body: &str) -> String {
    format!("cat >/dev/null; out=''\n{body}\nprintf '{{\"ok\":true,\"text\":\"%s\"}}' \"$out\"")
}

#[tokio::test(flavor = "multi_thread")]
async fn attack_read_the_api_key_anywhere() {
    let env = Env::new();
    // The key is assembled from halves so the probe's own command line never holds it.
    let probe = r#"
        cat > /tmp/turn.json
        K="sk-sec-otter"; K="$K-9191-never-inside"
        out=""
        grep -q "$K" /tmp/turn.json && out="$out turn-json"
        env | grep -q "$K" && out="$out env"
        for f in /proc/[0-9]*/environ /proc/[0-9]*/cmdline /proc/1/environ; do
          grep -q "$K" "$f" 2>/dev/null && out="$out $f"
        done
        # Each regular file once (`grep -r` read the one busybox again through each of its
        # applet links: 20 s of a busy machine, against the turn's 30 s deadline).
        find /workspace /run /tmp /etc /bin /roundtable-hostile /root-only -type f \
          -exec grep -ls "$K" {} + 2>/dev/null | grep -q . && out="$out files"
        # The one door out: the broker's answers, from an upstream that echoes the key it
        # was sent (in a completion, in an error body, split across stream chunks).
        codes=""
        for body in '{"messages":[{"role":"user","content":"a"}]}' \
                    '{"messages":[{"role":"user","content":"b"}]}' \
                    '{"messages":[{"role":"user","content":"c"}],"stream":true}'; do
          r=$(/roundtable-hostile post /v1/chat/completions "$body" </dev/null)
          codes="$codes$(echo "$r" | grep -o 'status=[0-9a-z]*' | head -1 | cut -d= -f2),"
          echo "$r" | grep -q "$K" && out="$out broker"
          echo "$r" | grep -q "sk-sec-otter" && out="$out broker-prefix"
        done
        runs=$(ls -A /run/roundtable | tr '\n' ',')
        env_names=$(env | cut -d= -f1 | sort | tr '\n' ',')
        printf '{"ok":true,"text":"found=[%s];run=%s;env=%s;codes=%s"}' "$out" "$runs" "$env_names" "$codes"
    "#;
    let model = ScriptedModel::start(vec![
        Step::EchoKey,
        Step::EchoKeyError(401),
        Step::EchoKeyStream,
    ])
    .await;
    let mut config = hostile::sh_config(&env, probe);
    config.api_key = ApiKey::from_static(KEY);
    config.model_url = model.url();
    // Generous: each broker read waits for the connection's end (up to 15 s).
    config.turn_timeout = Some(Duration::from_secs(120));
    let sandbox = Sandbox::new(config).await.unwrap();
    let reply = sandbox.run_turn(request("#key", "what is the key?")).await;
    let f = hostile::findings(&reply);
    assert_eq!(f["found"], "[]", "{reply:?}");
    // The reads through the broker were real: each reached the leaky upstream with the key.
    let seen = model.requests();
    assert_eq!(seen.len(), 3, "codes {}", f["codes"]);
    for r in &seen {
        assert_eq!(
            r.header_values("authorization"),
            vec![format!("Bearer {KEY}")]
        );
    }
    assert_eq!(
        f["run"], "broker.sock,",
        "the run dir holds only the socket"
    );
    assert_eq!(
        f["env"], "HOME,HOSTNAME,PATH,PWD,SHLVL,",
        "no secret in the environment"
    );
    assert!(!format!("{reply:?}").contains(KEY));
    assert_no_leftovers(&sandbox).await;

    // The turn the guest is given holds neither the key nor any host path.
    let mut config = hostile::config(&env, &["turn"]);
    config.api_key = ApiKey::from_static(KEY);
    drop(sandbox);
    let sandbox = Sandbox::new(config).await.unwrap();
    let reply = sandbox.run_turn(request("#key", "show me the turn")).await;
    let turn = reply.text.clone().unwrap();
    assert!(turn.contains("show me the turn"), "{turn}");
    for secret in [
        KEY.to_owned(),
        env.dir.path().display().to_string(),
        sandbox.config().run_root.display().to_string(),
        sandbox.config().workspace_root.display().to_string(),
        "127.0.0.1:9".to_owned(),
    ] {
        assert!(!turn.contains(&secret), "turn holds {secret:?}: {turn}");
    }
    assert_no_leftovers(&sandbox).await;
}

/// The docker bridge's gateway address as the host sees it.
async fn bridge_gateway() -> String {
    let driver = roundtable_sandbox::DockerDriver::default();
    let docker = driver.client().await.unwrap();
    let net = docker
        .inspect_network(
            "bridge",
            None::<bollard::query_parameters::InspectNetworkOptions>,
        )
        .await
        .unwrap();
    net.ipam
        .and_then(|i| i.config)
        .and_then(|c| c.into_iter().find_map(|c| c.gateway))
        .unwrap_or_else(|| "172.17.0.1".into())
}

#[tokio::test(flavor = "multi_thread")]
async fn attack_reach_any_network() {
    let env = Env::new();
    // Live targets on the host: a TCP listener on every address (the bridge gateway
    // included) and an abstract unix socket; both are reachable from the host itself.
    let tcp = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    tcp.set_nonblocking(true).unwrap();
    let port = tcp.local_addr().unwrap().port();
    let gateway = bridge_gateway().await;
    std::net::TcpStream::connect((gateway.as_str(), port)).expect("the gateway target is live");
    while tcp.accept().is_ok() {}
    let abstract_name = format!("roundtable-sec-{}", std::process::id());
    let abstract_listener = {
        use std::os::linux::net::SocketAddrExt;
        let addr =
            std::os::unix::net::SocketAddr::from_abstract_name(abstract_name.as_bytes()).unwrap();
        std::os::unix::net::UnixListener::bind_addr(&addr).unwrap()
    };
    abstract_listener.set_nonblocking(true).unwrap();

    let targets = [
        format!("tcp:{gateway}:{port}"),
        format!("tcp:127.0.0.1:{port}"),
        "tcp:1.1.1.1:443".to_owned(),
        format!("dns:{gateway}:53"),
        "dns:127.0.0.11:53".to_owned(),
        "dns:8.8.8.8:53".to_owned(),
        format!("abstract:{abstract_name}"),
        "unix:/run/roundtable/broker.sock".to_owned(),
    ];
    let args: Vec<&str> = std::iter::once("net")
        .chain(targets.iter().map(String::as_str))
        .collect();
    let sandbox = Sandbox::new(hostile::config(&env, &args)).await.unwrap();
    let reply = sandbox.run_turn(request("#net", "call home")).await;
    let f = hostile::findings(&reply);
    // The probe works: the one door out (the broker socket) answers.
    assert_eq!(f["unix:/run/roundtable/broker.sock"], "connected", "{f:?}");
    for t in &targets[..7] {
        let result = &f[t.as_str()];
        assert!(
            result.starts_with("error("),
            "{t} must be unreachable, got {result}"
        );
    }
    // 101 ENETUNREACH: no route at all (only `lo` exists); 111: the container's own loopback.
    // Under gVisor its own network stack (netstack) answers the same missing route with
    // 113 EHOSTUNREACH: still no route, nothing sent.
    let no_route = if under_gvisor() {
        "error(113)"
    } else {
        "error(101)"
    };
    assert_eq!(f[&targets[0]], no_route);
    assert_eq!(f[&targets[1]], "error(111)");
    assert_eq!(f[&format!("abstract:{abstract_name}")], "error(111)");
    assert!(tcp.accept().is_err(), "nothing reached the host listener");
    assert!(abstract_listener.accept().is_err());
    assert_no_leftovers(&sandbox).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn attack_write_to_the_run_dir() {
    let env = Env::new();
    let script = reply_after(
        r#"
        try() { if "$@" 2>/dev/null; then out="$out $1:WROTE"; else out="$out $1:refused"; fi; }
        try touch /run/roundtable/x
        try mkdir /run/roundtable/d
        try rm -f /run/roundtable/broker.sock
        try mv /run/roundtable/broker.sock /run/roundtable/b
        try ln -s /workspace /run/roundtable/l
        try chmod 777 /run/roundtable
        try mknod /run/roundtable/p p
        try sh -c 'echo x > /run/roundtable/broker.sock'
        try touch /etc/passwd
        try touch /new-root-file
        out="$out entries=$(ls -A /run/roundtable | tr '\n' ',')"
        "#,
    );
    let sandbox = Sandbox::new(hostile::sh_config(&env, &script))
        .await
        .unwrap();
    let reply = sandbox.run_turn(request("#rundir", "x")).await;
    let text = reply.text.clone().unwrap_or_else(|| panic!("{reply:?}"));
    assert!(!text.contains("WROTE"), "{text}");
    assert_eq!(text.matches(":refused").count(), 10, "{text}");
    assert!(text.ends_with("entries=broker.sock,"), "{text}");
    assert_no_leftovers(&sandbox).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn attack_reach_another_channels_workspace() {
    let env = Env::new();
    // Channel #a keeps a secret in its workspace: a marker of this run, in no program's
    // bytes (the static guest's 6 MB held "a-secret" by chance).
    let secret = format!("a-secret-{}", uuid::Uuid::new_v4().simple());
    let sandbox = Sandbox::new(hostile::sh_config(
        &env,
        &reply_after(&format!("echo {secret} > /workspace/secret-of-a")),
    ))
    .await
    .unwrap();
    assert!(sandbox.run_turn(request("#a", "x")).await.ok);
    let a_dir = env.workspace_of("#a");
    assert!(a_dir.join("secret-of-a").exists());

    // Channel #b looks for it everywhere, through the host path of its own mount (which
    // mountinfo shows), `..`, and a symlink planted for a later turn.
    let a_host = a_dir.display().to_string();
    let probe = reply_after(&format!(
        r#"
        found=$(find / -xdev -name 'secret-of-a*' 2>/dev/null | tr '\n' ',')
        out="$out find=[$found]"
        mine=$(grep ' /workspace ' /proc/self/mountinfo | cut -d' ' -f4)
        out="$out mount_root_is_segment=$(test "${{mine##*/}}" = "$(basename {a_host})" && echo A || echo B)"
        cat {a_host}/secret-of-a 2>/dev/null && out="$out host-path:READ"
        cat /workspace/../secret-of-a 2>/dev/null && out="$out dotdot:READ"
        ls /workspace/.. | grep -q secret && out="$out listing:SEEN"
        ln -s {a_host} /workspace/peek
        cat /workspace/peek/secret-of-a 2>/dev/null && out="$out symlink:READ"
        find / \( -path /proc -o -path /sys \) -prune -o -type f \
          -exec grep -ls {secret} {{}} + 2>/dev/null | grep -q . && out="$out grep:FOUND"
        "#
    ));
    drop(sandbox);
    let sandbox = Sandbox::new(hostile::sh_config(&env, &probe))
        .await
        .unwrap();
    let reply = sandbox.run_turn(request("#b", "x")).await;
    let text = reply.text.clone().unwrap_or_else(|| panic!("{reply:?}"));
    assert_eq!(text, " find=[] mount_root_is_segment=B", "{text}");
    // The planted link is still in #b's workspace; a later turn of #b follows it inside
    // its own container, where the host path does not exist.
    let follow =
        reply_after("cat /workspace/peek/secret-of-a 2>/dev/null && out=READ || out=refused");
    drop(sandbox);
    let sandbox = Sandbox::new(hostile::sh_config(&env, &follow))
        .await
        .unwrap();
    let reply = sandbox.run_turn(request("#b", "x")).await;
    assert_eq!(reply.text.as_deref(), Some("refused"));
    assert_no_leftovers(&sandbox).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn attack_reach_the_docker_socket() {
    let env = Env::new();
    let script = reply_after(
        r#"
        for s in /var/run/docker.sock /run/docker.sock /run/containerd/containerd.sock /docker.sock; do
          test -e "$s" && out="$out $s:PRESENT"
        done
        sockets=$(find / \( -path /proc -o -path /sys \) -prune -o -type s -print 2>/dev/null | tr '\n' ',')
        out="$out sockets=[$sockets]"
        grep -q docker.sock /proc/self/mountinfo && out="$out mountinfo:DOCKER"
        grep -qi docker_host /proc/self/environ && out="$out env:DOCKER_HOST"
        "#,
    );
    let sandbox = Sandbox::new(hostile::sh_config(&env, &script))
        .await
        .unwrap();
    let reply = sandbox.run_turn(request("#docker", "x")).await;
    assert_eq!(
        reply.text.as_deref(),
        Some(" sockets=[/run/roundtable/broker.sock,]"),
        "{reply:?}"
    );
    // And the hostile program's own connect attempts.
    drop(sandbox);
    let sandbox = Sandbox::new(hostile::config(
        &env,
        &["net", "unix:/var/run/docker.sock", "unix:/run/docker.sock"],
    ))
    .await
    .unwrap();
    let f = hostile::findings(&sandbox.run_turn(request("#docker", "x")).await);
    assert_eq!(f["unix:/var/run/docker.sock"], "error(2)");
    assert_eq!(f["unix:/run/docker.sock"], "error(2)");
    assert_no_leftovers(&sandbox).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn attack_escalate_through_a_setuid_binary() {
    use roundtable_sandbox::internals::docker::create_body;
    let env = Env::new();
    let uid = nix::unistd::getuid().as_raw();

    // Control: the bait works. In a container like the sealed one but without
    // no-new-privileges, the setuid-root program runs as root and reads the root-only file.
    // It runs straight, not under the guest's launcher: installing the guest's seccomp
    // layer sets no_new_privs too, which would hide what this control shows.
    let spec = control_spec(
        &env,
        "control",
        &["/bin/suid-hostile", "identity"],
        runtime(),
    );
    let mut body = create_body(&spec);
    body.host_config.as_mut().unwrap().security_opt = None;
    let control = run_raw_container(&spec.name, body).await;
    if under_gvisor() {
        // gVisor (20221219) does not honour the setuid bit of the bait at all: even without
        // no-new-privileges it runs as the service uid. The path this test attacks does not
        // exist there; the sealed checks below must still hold.
        assert!(
            control.contains(&format!("euid={uid};"))
                && control.contains("root_only=denied(permission denied)"),
            "under gVisor the bait stays unprivileged: {control}"
        );
    } else {
        assert!(
            control.contains("euid=0") && control.contains("root_only=READ:ROOT-ONLY-SECRET"),
            "the bait must work without no-new-privileges: {control}"
        );
    }

    // The sealed container: the setuid bit is inert, the file stays closed.
    let mut config = hostile::config(&env, &["identity"]);
    config.command = Some(hostile::under_the_guest(&["/bin/suid-hostile", "identity"]));
    let sealed = Sandbox::new(config).await.unwrap();
    let f = hostile::findings(&sealed.run_turn(request("#suid", "x")).await);
    assert_eq!(f["euid"], uid.to_string(), "{f:?}");
    assert_eq!(f["uids"], format!("{uid},{uid},{uid},{uid}"));
    assert_eq!(f["capeff"], "0000000000000000");
    if under_gvisor() {
        // gVisor's /proc/self/status has no NoNewPrivs line, and Docker's seccomp profile
        // is not loaded inside the sandbox (the guest's syscalls reach gVisor's Sentry, not
        // the host kernel). What reaches the host, the Sentry, runs with no_new_privs and
        // gVisor's own seccomp filter, as nobody: runtime::the_turn_process_on_the_host_is_confined.
        // Mode 2 inside is the guest's own layer, which the Sentry runs.
        assert_eq!(f["nnp"], "?");
        assert_eq!(f["seccomp"], "2", "the guest's seccomp layer is on");
    } else {
        assert_eq!(f["nnp"], "1");
        assert_eq!(f["seccomp"], "2", "the default seccomp filter is on");
    }
    assert_eq!(f["root_only"], "denied(permission denied)");
    assert_no_leftovers(&sealed).await;
    drop(sealed);

    // The other ways up: a setuid busybox, su, user namespaces, mount, chroot, raw sockets.
    let script = reply_after(
        r#"
        try() { if "$@" >/dev/null 2>&1; then out="$out $1:DID"; else out="$out $1:refused"; fi; }
        out="$out busybox-suid-id=$(/bin/busybox-suid id -u)"
        try /bin/busybox-suid cat /root-only
        try su -c true root
        try unshare -Ur true
        try unshare -m true
        try mount -t tmpfs none /tmp
        try chroot / true
        try ping -c1 -W1 127.0.0.1
        try chown 0 /workspace
        try nsenter -t 1 -m true
        try mknod /tmp/sda b 8 0
        "#,
    );
    let probe = Sandbox::new(hostile::sh_config(&env, &script))
        .await
        .unwrap();
    let reply = probe.run_turn(request("#suid", "x")).await;
    let text = reply.text.clone().unwrap_or_else(|| panic!("{reply:?}"));
    let text = if under_gvisor() && text.contains(" mknod:DID") {
        // gVisor (20221219) lets an unprivileged process mknod in its own tmpfs (it checks
        // neither CAP_MKNOD nor `nodev`), but such a node reaches no device: the Sentry
        // serves only the devices it emulates, so 8:0 (the host's first disk) answers
        // ENXIO to read and write. Checked here, then counted as refused.
        // A runtime holds its run root: this check gets roots of its own.
        let inert_env = Env::new();
        let inert = Sandbox::new(hostile::sh_config(
            &inert_env,
            &reply_after(
                "mknod /tmp/sda b 8 0 2>/dev/null; \
                 head -c1 /tmp/sda >/dev/null 2>&1 && out=read:DID || out=read:refused; \
                 { echo x > /tmp/sda; } 2>/dev/null && out=\"$out write:DID\" || out=\"$out write:refused\"",
            ),
        ))
        .await
        .unwrap();
        let r = inert.run_turn(request("#suid", "x")).await;
        assert_eq!(
            r.text.as_deref(),
            Some("read:refused write:refused"),
            "{r:?}"
        );
        assert_no_leftovers(&inert).await;
        text.replace(" mknod:DID", " mknod:refused")
    } else {
        text
    };
    assert!(text.contains(&format!("busybox-suid-id={uid}")), "{text}");
    assert!(!text.contains(":DID"), "{text}");
    assert_eq!(text.matches(":refused").count(), 10, "{text}");
    assert_no_leftovers(&probe).await;
}

/// A container like the sealed one (for a control run straight through the engine), with
/// its own run and workspace dirs named after `tag`, running `command` as the service uid.
fn control_spec(
    env: &Env,
    tag: &str,
    command: &[&str],
    runtime: Option<String>,
) -> roundtable_sandbox::driver::ContainerSpec {
    let ws = env.dir.path().join(format!("{tag}-ws"));
    std::fs::create_dir(&ws).unwrap();
    let run = env.dir.path().join(format!("{tag}-run"));
    std::fs::create_dir(&run).unwrap();
    roundtable_sandbox::driver::ContainerSpec {
        name: format!("roundtable-sec-{tag}-{}", std::process::id()),
        image: hostile::image(),
        run_dir: run,
        workspace_dir: ws,
        uid: nix::unistd::getuid().as_raw(),
        gid: nix::unistd::getgid().as_raw(),
        memory_mb: 64,
        cpus: 0.5,
        pids: 16,
        tmpfs_mb: 1,
        file_size_mb: 64,
        output_cap: 4096,
        stderr_cap: 4096,
        labels: Default::default(),
        command: Some(command.iter().map(|s| s.to_string()).collect()),
        runtime,
    }
}

/// Runs a container straight through the engine (no runtime) and returns its stdout.
async fn run_raw_container(name: &str, body: bollard::models::ContainerCreateBody) -> String {
    use bollard::query_parameters::{
        CreateContainerOptionsBuilder, LogsOptionsBuilder, RemoveContainerOptionsBuilder,
        WaitContainerOptions,
    };
    use futures_util::StreamExt;
    let driver = roundtable_sandbox::DockerDriver::default();
    let docker = driver.client().await.unwrap();
    let mut body = body;
    body.open_stdin = Some(false);
    body.attach_stdin = Some(false);
    body.host_config.as_mut().unwrap().log_config = None;
    let opts = CreateContainerOptionsBuilder::new().name(name).build();
    docker.create_container(Some(opts), body).await.unwrap();
    docker.start_container(name, None).await.unwrap();
    let _ = docker
        .wait_container(name, None::<WaitContainerOptions>)
        .collect::<Vec<_>>()
        .await;
    let logs = LogsOptionsBuilder::new().stdout(true).build();
    let out: Vec<_> = docker.logs(name, Some(logs)).collect().await;
    let text = out
        .into_iter()
        .flatten()
        .map(|o| o.to_string())
        .collect::<String>();
    let rm = RemoveContainerOptionsBuilder::new().force(true).build();
    docker.remove_container(name, Some(rm)).await.unwrap();
    text
}

#[tokio::test(flavor = "multi_thread")]
async fn attack_exhaust_pids() {
    let env = Env::new();
    // A fork bomb; the shell then waits and counts with builtins only (no fork) and answers.
    let mut config = hostile::sh_config(
        &env,
        r#"cat >/dev/null; b() { b | b & }; b
           i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done
           n=0; for p in /proc/[0-9]*; do n=$((n+1)); done
           printf '{"ok":true,"text":"%s"}' "$n""#,
    );
    config.limits.pids = 24;
    config.turn_timeout = Some(Duration::from_secs(20));
    let sandbox = Sandbox::new(config).await.unwrap();
    let started = Instant::now();
    let reply = sandbox.run_turn(request("#pids", "x")).await;
    // The shell answers while the bomb is held at the limit (or, if a failed fork ends the
    // shell, the exit is reported): either way a clear reply, never a hang.
    match (&reply.text, &reply.error) {
        (Some(n), None) => {
            let n: i64 = n.parse().unwrap();
            assert!((2..=24).contains(&n), "{n} processes");
        }
        (None, Some(e)) => assert!(e.starts_with("guest exited with code "), "{e}"),
        _ => panic!("{reply:?}"),
    }
    assert!(started.elapsed() < PROMPTLY);
    assert_no_leftovers(&sandbox).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn attack_exhaust_memory() {
    let env = Env::new();
    // The shell grows a variable without bound; the memory cgroup kills it.
    let mut config = hostile::sh_config(&env, "cat >/dev/null; x=a; while :; do x=$x$x; done");
    config.limits.memory_mb = 32;
    let sandbox = Sandbox::new(config).await.unwrap();
    let reply = sandbox.run_turn(request("#mem", "x")).await;
    assert_eq!(
        reply.error.as_deref(),
        Some("guest killed: out of memory (limit 32 MiB)")
    );
    assert_no_leftovers(&sandbox).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn attack_exhaust_tmpfs() {
    let env = Env::new();
    let mut config = hostile::sh_config(
        &env,
        &reply_after(
            "dd if=/dev/zero of=/tmp/fill bs=1M count=200 2>/dev/null; \
             out=$(($(stat -c %s /tmp/fill) / 1048576)); \
             echo more >> /tmp/other 2>/dev/null || out=\"$out full\"",
        ),
    );
    config.limits.tmpfs_mb = 8;
    let sandbox = Sandbox::new(config).await.unwrap();
    let reply = sandbox.run_turn(request("#tmpfs", "x")).await;
    assert_eq!(reply.text.as_deref(), Some("8 full"), "{reply:?}");
    assert_no_leftovers(&sandbox).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn attack_flood_stderr() {
    let env = Env::new();
    // 64 MiB on stderr, then a valid reply: stderr is drained (and capped), the reply stands.
    let sandbox = Sandbox::new(hostile::sh_config(
        &env,
        &reply_after("head -c 67108864 /dev/zero | tr '\\0' e >&2; out=done"),
    ))
    .await
    .unwrap();
    let reply = sandbox.run_turn(request("#stderr", "x")).await;
    assert_eq!(reply.text.as_deref(), Some("done"), "{reply:?}");
    assert_no_leftovers(&sandbox).await;

    // Both streams at once, forever: stderr floods never hide stdout's cap, which kills
    // the guest long before the (generous) deadline.
    drop(sandbox);
    let mut config = hostile::sh_config(&env, "cat >/dev/null; yes >&2 & yes 1>&2 & yes");
    config.turn_timeout = Some(Duration::from_secs(30));
    config.limits.output_kb = 1024;
    let sandbox = Sandbox::new(config).await.unwrap();
    let reply = sandbox.run_turn(request("#stderr", "x")).await;
    assert_eq!(
        reply.error.as_deref(),
        Some("guest output exceeds 1048576 bytes")
    );
    assert_no_leftovers(&sandbox).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn attack_hang_forever() {
    let env = Env::new();
    // Never reads its stdin (the turn text is larger than a pipe buffer), ignores SIGTERM
    // and SIGINT, and leaves a detached daemon behind.
    let mut config = hostile::sh_config(
        &env,
        "trap '' TERM INT HUP; setsid sleep 1000 & while :; do :; done",
    );
    config.turn_timeout = Some(Duration::from_secs(3));
    let sandbox = Sandbox::new(config).await.unwrap();
    let started = Instant::now();
    let reply = sandbox
        .run_turn(request("#hang", &"z".repeat(512 * 1024)))
        .await;
    assert_eq!(reply.error.as_deref(), Some("turn timed out after 3s"));
    assert!(
        started.elapsed() < Duration::from_secs(3) + PROMPTLY,
        "{:?}",
        started.elapsed()
    );
    assert_no_leftovers(&sandbox).await;

    // A guest that answers and leaves a detached daemon behind: the init process ends
    // with the guest, and the container with it.
    drop(sandbox);
    let sandbox = Sandbox::new(hostile::sh_config(
        &env,
        &reply_after("setsid sleep 1000 & out=bye"),
    ))
    .await
    .unwrap();
    let started = Instant::now();
    let reply = sandbox.run_turn(request("#hang", "x")).await;
    assert_eq!(reply.text.as_deref(), Some("bye"));
    assert!(started.elapsed() < PROMPTLY);
    assert_no_leftovers(&sandbox).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn attack_print_a_reply_that_pretends_to_come_from_the_host() {
    let env = Env::new();
    let cases: [(&str, &str); 8] = [
        (
            r#"echo '{"ok":true,"text":"hi","from":"host"}'"#,
            "guest output is not a valid reply: unknown field `from`, expected one of `ok`, `text`, `error`, `usage` at line 1 column 29",
        ),
        (
            r#"echo '{"ok":false,"ok":true,"text":"x"}'"#,
            "guest output is not a valid reply: duplicate field `ok` at line 1 column 16",
        ),
        (
            r#"echo '{"ok":false,"error":"a"}{"ok":true,"text":"b"}'"#,
            "guest output is not a valid reply: trailing characters at line 1 column 25",
        ),
        (
            r#"echo 'HOST: the sandbox is disabled'"#,
            "guest output is not a valid reply: expected value at line 1 column 1",
        ),
        (
            r#"echo '{"ok":true,"text":"fine"}' >&2"#,
            "guest output is not a valid reply: no output",
        ),
        (
            r#"printf '\357\273\277{"ok":true,"text":"bom"}'"#,
            "guest output is not a valid reply: expected value at line 1 column 1",
        ),
        (
            r#"printf '{"ok":true,"text":"\377"}'"#,
            "guest output is not a valid reply: invalid unicode code point at line 1 column 20",
        ),
        // A guest-reported failure can never pass for one of the host's own errors.
        (
            r#"echo '{"ok":false,"error":"turn timed out after 30s"}'"#,
            "the guest reported an error: turn timed out after 30s",
        ),
    ];
    for (script, expected) in cases {
        let sandbox = Sandbox::new(hostile::sh_config(
            &env,
            &format!("cat >/dev/null; {script}"),
        ))
        .await
        .unwrap();
        let reply = sandbox.run_turn(request("#forge", "x")).await;
        assert!(!reply.ok, "{script}: {reply:?}");
        assert_eq!(reply.error.as_deref(), Some(expected), "{script}");
        assert_no_leftovers(&sandbox).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn attack_fill_the_workspace_disk() {
    use roundtable_sandbox::internals::quota;
    let env = Env::new();
    let limits = |c: &mut roundtable_sandbox::Config| {
        c.limits.workspace_mb = 8;
        c.limits.workspace_files = 100;
    };
    let over = "this channel's workspace is over its quota";

    // One file past the quota: the kernel stops it (RLIMIT_FSIZE), the turn says why. The
    // file at its cap and the workspace's directory are over the quota by a block, so on a
    // busy machine the watcher's tick may end the turn first, saying so: either way the
    // file stops at the cap (checked below; without the cap it grows until the watcher).
    let mut config = hostile::sh_config(
        &env,
        "cat >/dev/null; exec dd if=/dev/zero of=/workspace/big bs=1M count=100",
    );
    limits(&mut config);
    let sandbox = Sandbox::new(config).await.unwrap();
    let reply = sandbox.run_turn(request("#big", "x")).await;
    let error = reply.error.unwrap();
    assert!(
        error == "guest killed: a file grew past the workspace quota (8 MiB)"
            || error.starts_with(over),
        "{error}"
    );
    let size = std::fs::metadata(env.workspace_of("#big").join("big"))
        .unwrap()
        .len();
    assert_eq!(size, 8 << 20, "the file stopped at the quota");
    // The workspace is at its quota; one more small file puts it over (this turn may
    // finish first, or be ended by the watcher), and the next turn is refused before any
    // container starts.
    let mut config = hostile::sh_config(&env, &reply_after("echo note > /workspace/note"));
    limits(&mut config);
    drop(sandbox);
    let sandbox = Sandbox::new(config).await.unwrap();
    let reply = sandbox.run_turn(request("#big", "x")).await;
    assert!(
        reply.ok || reply.error.as_deref().is_some_and(|e| e.starts_with(over)),
        "{reply:?}"
    );
    let reply = sandbox.run_turn(request("#big", "x")).await;
    let error = reply.error.unwrap();
    assert!(error.starts_with(over), "{error}");
    assert!(error.contains("the limit is 8 MiB"), "{error}");
    // An operator frees space: turns run again.
    std::fs::remove_file(env.workspace_of("#big").join("big")).unwrap();
    // (The watcher may have ended that turn before `echo` ran: no note then.)
    if let Err(e) = std::fs::remove_file(env.workspace_of("#big").join("note")) {
        assert_eq!(e.kind(), std::io::ErrorKind::NotFound, "{e}");
    }
    let mut config = hostile::sh_config(&env, &reply_after("out=back"));
    limits(&mut config);
    drop(sandbox);
    let sandbox = Sandbox::new(config).await.unwrap();
    assert_eq!(
        sandbox.run_turn(request("#big", "x")).await.text.as_deref(),
        Some("back")
    );
    assert_no_leftovers(&sandbox).await;

    // Many files, each under the per-file cap: the watcher kills the turn.
    let mut config = hostile::sh_config(
        &env,
        "cat >/dev/null; i=0; while :; do dd if=/dev/zero of=/workspace/f$i bs=1M count=1 2>/dev/null; i=$((i+1)); done",
    );
    limits(&mut config);
    drop(sandbox);
    let sandbox = Sandbox::new(config).await.unwrap();
    let started = Instant::now();
    let reply = sandbox.run_turn(request("#many", "x")).await;
    let error = reply.error.unwrap();
    assert!(error.starts_with(over), "{error}");
    assert!(started.elapsed() < PROMPTLY);
    let unbounded = quota::Quota {
        max_bytes: u64::MAX,
        max_entries: u64::MAX,
    };
    let used = quota::measure_dir(&env.workspace_of("#many"), &unbounded).unwrap();
    eprintln!("many files: {used:?} on disk after the kill (quota 8 MiB)");
    assert!(used.bytes < 512 << 20, "overshoot bounded: {used:?}");
    assert_no_leftovers(&sandbox).await;

    // An inode flood: the entry count is a quota too.
    let mut config = hostile::sh_config(
        &env,
        "cat >/dev/null; i=0; while :; do : > /workspace/n$i; i=$((i+1)); done",
    );
    limits(&mut config);
    drop(sandbox);
    let sandbox = Sandbox::new(config).await.unwrap();
    let reply = sandbox.run_turn(request("#inodes", "x")).await;
    let error = reply.error.unwrap();
    assert!(error.starts_with(over), "{error}");
    assert!(error.contains("more than 100 entries"), "{error}");
    assert_no_leftovers(&sandbox).await;

    // Bytes hidden in a dir the guest made unreadable: the host cannot count them and never
    // changes the dir's mode, so the workspace counts as over quota (tests/security_quota.rs
    // plays it against the watcher).
    let mut config = hostile::sh_config(
        &env,
        &reply_after(
            "mkdir /workspace/h; dd if=/dev/zero of=/workspace/h/a bs=1M count=5 2>/dev/null; \
             chmod 000 /workspace/h; ln -s / /workspace/root; out=hidden",
        ),
    );
    limits(&mut config);
    drop(sandbox);
    let sandbox = Sandbox::new(config).await.unwrap();
    // The turn answers, or the watcher sees the locked dir first and ends it.
    let reply = sandbox.run_turn(request("#hide", "x")).await;
    assert!(
        reply.text.as_deref() == Some("hidden")
            || reply
                .error
                .as_deref()
                .is_some_and(|e| e.starts_with("this channel's workspace cannot be measured")),
        "{reply:?}"
    );
    // The operator's fix when the test ends, so its scratch dir can be removed.
    struct Unlock(std::path::PathBuf);
    impl Drop for Unlock {
        fn drop(&mut self) {
            use std::os::unix::fs::PermissionsExt;
            let _ = std::fs::set_permissions(&self.0, std::fs::Permissions::from_mode(0o700));
        }
    }
    let _unlock = Unlock(env.workspace_of("#hide").join("h"));
    let hidden = quota::measure_dir(&env.workspace_of("#hide"), &unbounded).unwrap_err();
    assert!(
        matches!(hidden, quota::MeasureError::Unreadable(_)),
        "{hidden}"
    );
    let reply = sandbox.run_turn(request("#hide", "x")).await;
    assert!(
        reply
            .error
            .as_deref()
            .is_some_and(|e| e.starts_with("this channel's workspace cannot be measured")),
        "{reply:?}"
    );
    assert_no_leftovers(&sandbox).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn attack_hide_data_from_the_quota_past_path_max() {
    let env = Env::new();
    // Nest dirs past PATH_MAX (25 levels of 200-byte names), then write there forever:
    // a path-based measure cannot reach it, so the workspace counts as over quota.
    let mut config = hostile::sh_config(
        &env,
        "cat >/dev/null; n=$(printf '%0200d' 0); i=0; cd /workspace; \
         while [ $i -lt 25 ]; do mkdir $n; cd $n; i=$((i+1)); done; \
         i=0; while :; do dd if=/dev/zero of=f$i bs=1M count=1 2>/dev/null; i=$((i+1)); done",
    );
    config.limits.workspace_mb = 64;
    let sandbox = Sandbox::new(config).await.unwrap();
    let started = Instant::now();
    let reply = sandbox.run_turn(request("#deep", "x")).await;
    let error = reply.error.unwrap();
    eprintln!(
        "nested past PATH_MAX: {error} after {:?}",
        started.elapsed()
    );
    assert!(
        error.starts_with("this channel's workspace cannot be measured")
            || error.starts_with("this channel's workspace is over its quota"),
        "{error}"
    );
    assert!(started.elapsed() < PROMPTLY, "{:?}", started.elapsed());
    // And the next turn is refused before any container starts.
    let reply = sandbox.run_turn(request("#deep", "x")).await;
    let error = reply.error.unwrap();
    assert!(error.contains("an operator must"), "{error}");
    assert_no_leftovers(&sandbox).await;
    // The operator clears it (remove_dir_all walks by descriptor, past PATH_MAX).
    std::fs::remove_dir_all(env.workspace_of("#deep")).unwrap();
}

/// The calls the guest's own seccomp layer refuses (guest/src/seccomp.rs), as the hostile
/// `forbidden` probe names them: each needs no privilege, only the same uid.
/// (`fallocate(FALLOC_FL_KEEP_SIZE)` is probed by security_quota, on a disk filesystem.)
const REFUSED_BY_THE_LAYER: [&str; 7] = [
    "ptrace_sibling",
    "ptrace_init",
    "process_vm_readv_sibling",
    "pidfd_getfd_sibling",
    "kcmp_sibling",
    "io_uring_setup",
    "sendmsg",
];

#[tokio::test(flavor = "multi_thread")]
async fn attack_syscalls_that_seccomp_and_the_dropped_capabilities_forbid() {
    use roundtable_sandbox::internals::docker::{create_body, GUEST_OOM_SCORE_ADJ};
    let env = Env::new();
    let layer = REFUSED_BY_THE_LAYER;
    let profile = [
        "keyctl",
        "bpf",
        "userfaultfd",
        "perf_event_open",
        "mount",
        "unshare_newuser",
    ];

    // Controls: the probe sees success. Two containers like the sealed one, the probe run
    // straight (not under the guest's launcher, so without the guest's layer), under runc:
    // (a) with `seccomp=unconfined`: every call that needs no capability goes through
    //     (`bpf` and `mount` still fail: they need one);
    // (b) with Docker's default profile alone: what the profile leaves open, the layer's
    //     calls among them (ptrace of a sibling above all: the profile allows it on
    //     kernels >= 4.8, and this host has no Yama). So the refusals in the sealed turn
    //     below are the layer's, not the profile's.
    let control = |tag: &str, unconfined: bool| {
        let tag = format!("seccomp-{tag}");
        // The controls are about Docker's seccomp profile, which runc applies.
        let spec = control_spec(&env, &tag, &["/roundtable-hostile", "forbidden"], None);
        let mut body = create_body(&spec);
        if unconfined {
            body.host_config
                .as_mut()
                .unwrap()
                .security_opt
                .as_mut()
                .unwrap()
                .push("seccomp=unconfined".into());
        }
        (spec.name, body)
    };
    let (name, body) = control("unconfined", true);
    let unconfined = run_raw_container(&name, body).await;
    eprintln!("forbidden calls without any filter: {unconfined}");
    for call in [
        "keyctl",
        "userfaultfd",
        "perf_event_open",
        "unshare_newuser",
    ]
    .iter()
    .chain(&layer)
    {
        assert!(
            unconfined.contains(&format!("{call}=allowed")),
            "{call} must work without the seccomp filters: {unconfined}"
        );
    }
    for call in ["bpf", "mount"] {
        assert!(
            unconfined.contains(&format!("{call}=errno(1)")),
            "{unconfined}"
        );
    }
    let (name, body) = control("profile", false);
    let profile_only = run_raw_container(&name, body).await;
    eprintln!("forbidden calls under Docker's profile alone: {profile_only}");
    for call in profile {
        assert!(
            profile_only.contains(&format!("{call}=errno(1)")),
            "{call}: {profile_only}"
        );
    }
    for call in ["ptrace_sibling", "ptrace_init", "io_uring_setup", "sendmsg"] {
        assert!(
            profile_only.contains(&format!("{call}=allowed")),
            "Docker's profile alone lets {call} through (the reason for the layer): {profile_only}"
        );
    }

    // The sealed turn, the probe under the guest's launcher: each is refused with EPERM
    // (the filters' and the kernel's answer without the capability alike).
    let sandbox = Sandbox::new(hostile::config(&env, &["forbidden"]))
        .await
        .unwrap();
    let reply = sandbox.run_turn(request("#syscalls", "x")).await;
    let f = hostile::findings(&reply);
    eprintln!("forbidden calls in the sealed container: {f:?}");
    // The layer's refusals, in both runtimes (gVisor runs the guest's seccomp filters in
    // its Sentry: `sendmsg`, which gVisor serves, gets EPERM there too).
    for call in &layer {
        if *call == "pidfd_getfd_sibling" && under_gvisor() {
            // gVisor (20221219) has no pidfd_open, so the probe gets no pidfd to try.
            assert_eq!(f[*call], "pidfd_open-errno(38)", "{f:?}");
            continue;
        }
        assert_eq!(f[*call], "errno(1)", "{call}: {f:?}");
    }
    if under_gvisor() {
        // The guest's system calls reach gVisor's Sentry, not the host kernel: each is
        // refused by the Sentry (its own errno), except `unshare(CLONE_NEWUSER)`, which the
        // Sentry implements inside the sandbox (no host kernel object). `/proc/self/limits`
        // and the host-side OOM score are the Sentry's business, not visible inside.
        for (call, errno) in [
            ("keyctl", "errno(13)"),
            ("bpf", "errno(1)"),
            ("userfaultfd", "errno(38)"),
            ("perf_event_open", "errno(19)"),
            ("mount", "errno(1)"),
        ] {
            assert_eq!(f[call], errno, "{call}: {f:?}");
        }
        assert_eq!(f["unshare_newuser"], "allowed", "{f:?}");
        assert_no_leftovers(&sandbox).await;
        return;
    }
    for call in profile {
        assert_eq!(f[call], "errno(1)", "{call}: {f:?}");
    }
    // No core dump can be written or handed to the host's handler; a guest is the first
    // pick of the host's OOM killer.
    assert_eq!(f["core"], "0,0", "soft and hard core limits: {f:?}");
    assert_eq!(f["oom_score_adj"], GUEST_OOM_SCORE_ADJ.to_string());
    assert_no_leftovers(&sandbox).await;
}

/// The guest's layer fails closed: where the kernel refuses it (here the engine's own
/// profile answers `seccomp(2)` with EPERM), the guest replies with the error and runs
/// nothing. The control: the same container under Docker's default profile runs the
/// program. Both under runc (the engine's profile is what runc applies).
#[tokio::test(flavor = "multi_thread")]
async fn the_guest_runs_nothing_when_its_seccomp_layer_cannot_be_installed() {
    use roundtable_sandbox::internals::docker::create_body;
    let env = Env::new();
    let command = [
        "/roundtable-guest",
        "--exec",
        "/bin/sh",
        "-c",
        "echo RAN-UNCONFINED",
    ];
    let run = |tag: &str, profile: Option<&str>| {
        let spec = control_spec(&env, tag, &command, None);
        let mut body = create_body(&spec);
        if let Some(profile) = profile {
            body.host_config
                .as_mut()
                .unwrap()
                .security_opt
                .get_or_insert_with(Vec::new)
                .push(format!("seccomp={profile}"));
        }
        (spec.name, body)
    };
    let (name, body) = run("layer-control", None);
    let control = run_raw_container(&name, body).await;
    assert_eq!(control.trim(), "RAN-UNCONFINED", "{control}");

    let no_seccomp = r#"{"defaultAction":"SCMP_ACT_ALLOW","syscalls":[{"names":["seccomp"],"action":"SCMP_ACT_ERRNO"}]}"#;
    let (name, body) = run("layer-refused", Some(no_seccomp));
    let out = run_raw_container(&name, body).await;
    assert!(!out.contains("RAN"), "ran without its layer: {out}");
    let reply =
        roundtable_sandbox::internals::turn::parse_reply(out.trim().as_bytes(), 4096).unwrap();
    assert!(!reply.ok, "{reply:?}");
    let error = reply.error.unwrap_or_default();
    assert!(
        error.contains("cannot install the seccomp filter"),
        "{error}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn attack_print_host_error_wording_in_an_ok_reply() {
    // What the bot sees: an ok reply's text is the agent's answer and is passed as is,
    // whatever it says; it is never turned into (or marked as) an error. The host's own
    // failures arrive only as `ok: false` with `error`, and a failure the guest reports is
    // prefixed as the guest's (the case above). A program that acts on failures (alerts,
    // retries, metrics) keys off `ok`/`error`, which the guest cannot forge.
    let env = Env::new();
    let texts = [
        "turn timed out after 30s",
        "turn stopped",
        "guest killed: out of memory (limit 512 MiB)",
        "docker daemon unreachable: connection refused",
        "the guest reported an error: none",
        "error: sandbox image not found",
    ];
    for text in texts {
        let script = format!("cat >/dev/null; printf '{{\"ok\":true,\"text\":\"%s\"}}' '{text}'");
        let sandbox = Sandbox::new(hostile::sh_config(&env, &script))
            .await
            .unwrap();
        let reply = sandbox.run_turn(request("#okforge", "x")).await;
        assert!(reply.ok, "{text}: {reply:?}");
        assert_eq!(reply.error, None, "{text}");
        assert_eq!(reply.text.as_deref(), Some(text));
        assert_no_leftovers(&sandbox).await;
    }
}
