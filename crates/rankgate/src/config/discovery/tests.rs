use super::super::whole::Config;
use super::*;

fn parse(d: &str) -> Result<Config, String> {
    Config::from_str(&format!("[[discovery]]\n{d}")).map_err(|e| e.to_string())
}

#[test]
fn dns_entry_with_defaults() {
    let c =
        parse("kind = \"dns\"\nname = \"vllm.svc\"\nport = 8000\nflavor = \"vllm\"\ndp_size = 2")
            .unwrap();
    assert!(c.engines.is_empty());
    let d = &c.discovery[0];
    assert_eq!(
        d.source,
        Source::Dns {
            name: "vllm.svc".into(),
            port: Some(8000),
            grpc_port: None,
            resolver: None,
            interval: DEFAULT_DNS_INTERVAL
        }
    );
    let e = d
        .template
        .engine(
            "x",
            "10.0.0.7".parse().unwrap(),
            Some(8000),
            None,
            Overrides {
                start_rank: Some(4),
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(&*e.url, "http://10.0.0.7:8000");
    assert_eq!((e.dp_size, e.start_rank), (2, 4));
    let v6 = d
        .template
        .engine(
            "x",
            "fd00::1".parse().unwrap(),
            Some(8000),
            Some(50051),
            Overrides::default(),
        )
        .unwrap();
    assert_eq!(&*v6.url, "http://[fd00::1]:8000");
    assert_eq!(v6.grpc.as_deref(), Some("[fd00::1]:50051"));
}

#[cfg(feature = "kubernetes")]
#[test]
fn kubernetes_entry_takes_port_names() {
    let c = parse(
        "kind = \"kubernetes\"\nnamespace = \"llm\"\nselector = \"app=vllm\"\nport = \"http\"\ngrpc_port = 50051\nflavor = \"sglang\"",
    )
    .unwrap();
    match &c.discovery[0].source {
        Source::Kubernetes {
            port, grpc_port, ..
        } => {
            assert_eq!(port, &Some(PortRef::Name("http".into())));
            assert_eq!(grpc_port, &Some(PortRef::Number(50051)));
        }
        s => panic!("{s:?}"),
    }
}

#[test]
fn bad_entries_are_named() {
    for (text, want) in [
        ("kind = \"dns\"\nport = 1\nflavor = \"vllm\"", "discovery[0].name"),
        ("kind = \"dns\"\nname = \"a..b\"\nport = 1\nflavor = \"vllm\"", "empty label"),
        ("kind = \"dns\"\nname = \"-a.b\"\nport = 1\nflavor = \"vllm\"", "starting or ending"),
        ("kind = \"dns\"\nname = \"a b\"\nport = 1\nflavor = \"vllm\"", "only letters"),
        ("kind = \"dns\"\nname = \"a\"\nflavor = \"vllm\"", "needs `port`"),
        ("kind = \"dns\"\nname = \"a\"\nport = \"http\"\nflavor = \"vllm\"", "port number"),
        ("kind = \"dns\"\nname = \"a\"\nport = 1\nresolver = \"x\"\nflavor = \"vllm\"", "discovery[0].resolver"),
        ("kind = \"dns\"\nname = \"a\"\nport = 1\nnamespace = \"x\"\nflavor = \"vllm\"", "discovery[0].namespace"),
        ("kind = \"kubernetes\"\nnamespace = \"n\"\nport = 1\nflavor = \"vllm\"", "discovery[0].selector"),
        ("kind = \"kubernetes\"\nnamespace = \"n\"\nselector = \"a=b\"\nport = 1\nname = \"x\"\nflavor = \"vllm\"", "discovery[0].name"),
        ("kind = \"dns\"\nname = \"a\"\nport = 1\ndp_size = 0\nflavor = \"vllm\"", "discovery[0].dp_size"),
        ("kind = \"dns\"\nname = \"a\"\nport = 1\nflavor = \"gateway\"\ndp_size = 2", "discovery[0].dp_size"),
        ("kind = \"dns\"\nname = \"a\"\nport = 1\nflavor = \"vllm\"\nbogus = 1", "bogus"),
    ] {
        let err = parse(text).unwrap_err();
        // A build without the feature refuses the kind itself.
        let unbuilt = text.contains("kubernetes")
            && !cfg!(feature = "kubernetes")
            && err.contains("built without Kubernetes discovery");
        assert!(err.contains(want) || unbuilt, "{text}: {err}");
    }
}
