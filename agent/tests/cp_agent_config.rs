//! The agent config: the example in deploy/ parses (the live problem: no instance), and
//! `coordinator_shards` and `[nic]` are read and checked.

use drum_agent::AgentSettings;
use std::path::Path;

#[test]
fn deploy_example_parses_and_shards_are_read() {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/config/agent.toml");
    let (s, o) = AgentSettings::load_with_options(&example).unwrap();
    assert_eq!(s.host, "h0");
    assert_eq!(s.instance, None, "the deployed agent runs the live problem");
    assert!(o.coordinator_shards.is_empty());
    let nic = o.nic.clone().unwrap();
    assert_eq!((nic.max_active, nic.wqe_budget), (16, 1.0));
    let (params, gids) = nic
        .resolve(o.shim.as_ref().unwrap().line_rate_gbps)
        .unwrap();
    assert_eq!(params.line_rate_gbps, 100.0);
    assert!(!gids.is_empty(), "the host's interface addresses");
    let dir = tempfile::tempdir().unwrap();
    let write = |extra: &str| {
        let p = dir.path().join("a.toml");
        std::fs::write(
            &p,
            format!(
                "host = \"h0\"\ninstance = \"i.json\"\ncoordinator = \"127.0.0.1:7400\"\n{extra}\n\
                 [tls]\nca = \"a\"\ncert = \"b\"\nkey = \"c\"\n"
            ),
        )
        .unwrap();
        p
    };
    let (_, o) = AgentSettings::load_with_options(&write(
        "coordinator_shards = [\"127.0.0.1:7401\", \"127.0.0.1:7402\"]",
    ))
    .unwrap();
    assert_eq!(o.coordinator_shards.len(), 2);
    assert!(!o.apps_from_shims);
    for (extra, want) in [
        (
            "coordinator_shard = []",
            "unknown field `coordinator_shard`",
        ),
        (
            "coordinator_shards = [\"nowhere\"]",
            "invalid socket address",
        ),
        ("apps_from_shims = true", "apps_from_shims in"),
        ("[nic]\nmax_active = 4", "[nic] in"),
    ] {
        let e = AgentSettings::load_with_options(&write(extra)).unwrap_err();
        assert!(format!("{e:#}").contains(want), "{extra}: {e:#}");
    }
    // Without an instance: the live problem, which needs [shim] and one coordinator.
    let live = |extra: &str| {
        let p = dir.path().join("live.toml");
        std::fs::write(
            &p,
            format!(
                "host = \"h0\"\ncoordinator = \"127.0.0.1:7400\"\n{extra}\n\
                 [tls]\nca = \"a\"\ncert = \"b\"\nkey = \"c\"\n"
            ),
        )
        .unwrap();
        AgentSettings::load_with_options(&p)
    };
    let e = live("").unwrap_err();
    assert!(format!("{e:#}").contains("needs [shim]"), "{e:#}");
    let shim = "[shim]\nline_rate_gbps = 10.0\n";
    let e = live(&format!(
        "coordinator_shards = [\"127.0.0.1:7401\"]\n{shim}"
    ))
    .unwrap_err();
    assert!(format!("{e:#}").contains("one coordinator"), "{e:#}");
    let (_, o) = live(&format!(
        "{shim}[nic]\ngids = [\"10.0.0.7\"]\nmax_active = 4\n"
    ))
    .unwrap();
    let (nic, gids) = o.nic.unwrap().resolve(10.0).unwrap();
    assert_eq!((nic.line_rate_gbps, nic.max_active), (10.0, 4));
    assert_eq!(
        gids,
        [drum_table::message::gid_of_ipv4([10, 0, 0, 7].into())]
    );
    for (nic, want) in [
        ("gids = [\"fe80::1\"]", "neither an IPv4 address"),
        ("max_active = 0", "max_active must be in"),
        ("wqe_budget = nan", "wqe_budget"),
        ("max_active = 1000\nwqe_budget = 1.0", "need a wqe_budget"),
    ] {
        let (_, o) = live(&format!("{shim}[nic]\n{nic}\n")).unwrap();
        let e = o.nic.unwrap().resolve(10.0).unwrap_err();
        assert!(format!("{e:#}").contains(want), "{nic}: {e:#}");
    }
}
