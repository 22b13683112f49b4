//! PromQL's tokens, as the reader in [`crate::promql`] needs them.

#[derive(Clone, Debug, PartialEq)]
pub enum Tok {
    Ident(String),
    Num,
    Str(String),
    /// `[...]`: a range or subquery, its content skipped.
    Range,
    Op(&'static str),
    Open(char),
    Close(char),
    Comma,
}

pub fn tokens(expr: &str) -> Result<Vec<Tok>, String> {
    const OPS: [&str; 17] = [
        "==", "!=", "<=", ">=", "=~", "!~", "+", "-", "*", "/", "%", "^", "<", ">", "=", "(", ")",
    ];
    let mut out = Vec::new();
    let mut rest = expr.trim_start();
    while let Some(c) = rest.chars().next() {
        let len = if c.is_ascii_alphabetic() || c == '_' {
            let n = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
                .unwrap_or(rest.len());
            out.push(Tok::Ident(rest[..n].to_string()));
            n
        } else if c.is_ascii_digit() || c == '.' {
            out.push(Tok::Num);
            (rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '.'))).unwrap_or(rest.len())
        } else if c == '"' || c == '\'' {
            let n = 1 + rest[1..].find(c).ok_or("unterminated string")?;
            out.push(Tok::Str(rest[1..n].to_string()));
            n + 1
        } else if c == '[' {
            out.push(Tok::Range);
            1 + rest.find(']').ok_or("unterminated range")?
        } else if let Some(op) = OPS.iter().find(|op| rest.starts_with(**op)) {
            out.push(match *op {
                "(" => Tok::Open('('),
                ")" => Tok::Close(')'),
                op => Tok::Op(op),
            });
            op.len()
        } else {
            out.push(match c {
                '{' => Tok::Open('{'),
                '}' => Tok::Close('}'),
                ',' => Tok::Comma,
                c => return Err(format!("unexpected {c:?}")),
            });
            1
        };
        rest = rest[len..].trim_start();
    }
    Ok(out)
}
