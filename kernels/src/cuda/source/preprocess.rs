//! Just enough of the C preprocessor to list the kernels a module defines: line splicing,
//! comments, `#define` / `#undef` of function-like macros and their expansion (`#`, `##`,
//! `__VA_ARGS__`, rescanning with hide sets), so the names NVRTC will see come from the
//! instantiation macros of the source itself (`FLOATS(NORM_ENTRIES)`,
//! `MERGE_ENTRIES(f32, float)`, `ALL_TYPES(CAST_TO)` through a nested macro).
//!
//! Object-like macros are left unexpanded: no entry name is built from one. Conditional
//! directives are refused rather than ignored, since the entries would then depend on
//! definitions this reader cannot see.

use std::collections::HashMap;
use std::rc::Rc;

/// A preprocessing token: its text and the macros whose expansion produced it (a macro is
/// not expanded again inside its own expansion).
#[derive(Clone, Debug)]
struct Tok {
    text: String,
    hide: Rc<Vec<String>>,
}

impl Tok {
    fn is_ident(&self) -> bool {
        is_ident(&self.text)
    }
}

fn is_ident(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// A function-like macro.
#[derive(Debug)]
struct Macro {
    params: Vec<String>,
    variadic: bool,
    body: Vec<Tok>,
}

/// The names of every `extern "C" __global__ void name(…)` definition of `text` after
/// macro expansion, in order. A `__global__` in any other form is an error: the kernel table
/// and the parameter reader (`parse_entries`) know only that one.
pub(super) fn global_functions(text: &str) -> Result<Vec<String>, String> {
    let tokens = expand_source(text)?;
    let mut names = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        if t.text != "__global__" {
            continue;
        }
        let text_at = |k: usize| tokens.get(k).map(|t| t.text.as_str());
        let declared = i >= 2
            && text_at(i - 2) == Some("extern")
            && text_at(i - 1) == Some("\"C\"")
            && text_at(i + 1) == Some("void")
            && tokens.get(i + 2).is_some_and(Tok::is_ident)
            && text_at(i + 3) == Some("(");
        if !declared {
            let around: Vec<&str> = tokens[i.saturating_sub(2)..(i + 4).min(tokens.len())]
                .iter()
                .map(|t| t.text.as_str())
                .collect();
            return Err(format!(
                "a kernel not written `extern \"C\" __global__ void name(…)`: `{}`",
                around.join(" ")
            ));
        }
        names.push(tokens[i + 2].text.clone());
    }
    Ok(names)
}

/// `text` with lines spliced, comments removed, directives applied and every function-like
/// macro expanded.
fn expand_source(text: &str) -> Result<Vec<Tok>, String> {
    let text = strip_comments(&text.replace("\\\r\n", "").replace("\\\n", ""))?;
    let mut macros: HashMap<String, Macro> = HashMap::new();
    let mut out = Vec::new();
    let mut pending = Vec::new();
    for line in text.lines() {
        let Some(directive) = line.trim_start().strip_prefix('#') else {
            pending.extend(tokenize(line)?);
            continue;
        };
        out.extend(expand(std::mem::take(&mut pending), &macros)?);
        let directive = directive.trim_start();
        let word_end = directive
            .find(|c: char| !c.is_ascii_alphanumeric())
            .unwrap_or(directive.len());
        let (word, rest) = directive.split_at(word_end);
        match word {
            "define" => {
                let (name, mac) = define(rest)?;
                match mac {
                    Some(m) => macros.insert(name, m),
                    None => macros.remove(&name),
                };
            }
            "undef" => {
                macros.remove(rest.trim());
            }
            "" | "pragma" | "include" => {}
            other => return Err(format!("directive `#{other}` is not understood")),
        }
    }
    out.extend(expand(pending, &macros)?);
    Ok(out)
}

/// The name of a `#define` (after the word) and its macro, `None` for an object-like one.
fn define(rest: &str) -> Result<(String, Option<Macro>), String> {
    let rest = rest.trim_start();
    let name_end = rest
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(rest.len());
    let (name, rest) = rest.split_at(name_end);
    if !is_ident(name) {
        return Err(format!("`#define {rest}` names no macro"));
    }
    // Function-like only when `(` follows the name directly.
    let Some(rest) = rest.strip_prefix('(') else {
        return Ok((name.to_string(), None));
    };
    let close = rest
        .find(')')
        .ok_or_else(|| format!("macro `{name}`: no `)` after its parameters"))?;
    let mut params: Vec<String> = rest[..close]
        .split(',')
        .map(|p| p.trim().to_string())
        .filter(|p| !p.is_empty())
        .collect();
    let variadic = params.last().is_some_and(|p| p == "...");
    if variadic {
        params.pop();
    }
    if let Some(bad) = params.iter().find(|p| !is_ident(p)) {
        return Err(format!("macro `{name}`: parameter `{bad}`"));
    }
    let body = tokenize(&rest[close + 1..])?;
    Ok((
        name.to_string(),
        Some(Macro {
            params,
            variadic,
            body,
        }),
    ))
}

/// `text` without its `//` and `/* */` comments (each replaced by a space, as C does), string
/// and character literals kept whole.
fn strip_comments(text: &str) -> Result<String, String> {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '/' if chars.peek() == Some(&'/') => {
                while chars.peek().is_some_and(|&c| c != '\n') {
                    chars.next();
                }
                out.push(' ');
            }
            '/' if chars.peek() == Some(&'*') => {
                chars.next();
                let mut last = ' ';
                loop {
                    match chars.next() {
                        Some('/') if last == '*' => break,
                        Some(c) => last = c,
                        None => return Err("a `/*` comment is not closed".into()),
                    }
                }
                out.push(' ');
            }
            '"' | '\'' => {
                out.push(c);
                loop {
                    match chars.next() {
                        Some('\\') => {
                            out.push('\\');
                            out.extend(chars.next());
                        }
                        Some(q) if q == c => {
                            out.push(q);
                            break;
                        }
                        Some('\n') | None => {
                            return Err(format!("a {c}…{c} literal is not closed"))
                        }
                        Some(other) => out.push(other),
                    }
                }
            }
            c => out.push(c),
        }
    }
    Ok(out)
}

/// The preprocessing tokens of one line (comments already removed).
fn tokenize(line: &str) -> Result<Vec<Tok>, String> {
    let bytes = line.as_bytes();
    let no_hide = Rc::new(Vec::new());
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        let start = i;
        if c.is_ascii_whitespace() {
            i += 1;
            continue;
        }
        let word = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
        if word(c) || (c == b'.' && bytes.get(i + 1).is_some_and(u8::is_ascii_digit)) {
            // Identifiers, and numbers with their suffixes and exponents.
            let number = c.is_ascii_digit() || c == b'.';
            while i < bytes.len() && (word(bytes[i]) || (number && bytes[i] == b'.')) {
                let exponent = number && matches!(bytes[i], b'e' | b'E' | b'p' | b'P');
                i += 1;
                if exponent && matches!(bytes.get(i), Some(b'+' | b'-')) {
                    i += 1;
                }
            }
        } else if c == b'"' || c == b'\'' {
            i += 1;
            while i < bytes.len() && bytes[i] != c {
                i += if bytes[i] == b'\\' { 2 } else { 1 };
            }
            if i >= bytes.len() {
                return Err(format!("a literal is not closed in `{line}`"));
            }
            i += 1;
        } else if line[i..].starts_with("##") || line[i..].starts_with("::") {
            i += 2;
        } else {
            // Other punctuators one character at a time: enough to find names and brackets.
            i += line[i..].chars().next().map_or(1, char::len_utf8);
        }
        out.push(Tok {
            text: line[start..i].to_string(),
            hide: no_hide.clone(),
        });
    }
    Ok(out)
}

/// How deep expansions may nest before the source is called malformed.
const MAX_DEPTH: usize = 64;

/// `input` with every function-like macro invocation expanded and the result rescanned.
fn expand(input: Vec<Tok>, macros: &HashMap<String, Macro>) -> Result<Vec<Tok>, String> {
    // The tokens still to read, the next one last, so an expansion is pushed back in front of
    // the rest of the input and rescanned with it.
    let mut todo: Vec<Tok> = input.into_iter().rev().collect();
    let mut out = Vec::new();
    while let Some(t) = todo.pop() {
        let invoked = macros
            .get(&t.text)
            .filter(|_| !t.hide.contains(&t.text))
            .filter(|_| todo.last().is_some_and(|n| n.text == "("));
        let Some(mac) = invoked else {
            out.push(t);
            continue;
        };
        if t.hide.len() >= MAX_DEPTH {
            return Err(format!("macro `{}` nests deeper than {MAX_DEPTH}", t.text));
        }
        let args = arguments(&t.text, &mut todo)?;
        let mut hide = (*t.hide).clone();
        hide.push(t.text.clone());
        let body = substitute(&t.text, mac, args, &Rc::new(hide), macros)?;
        todo.extend(body.into_iter().rev());
    }
    Ok(out)
}

/// The arguments of an invocation of `name`, read from `todo` (which starts at its `(`).
fn arguments(name: &str, todo: &mut Vec<Tok>) -> Result<Vec<Vec<Tok>>, String> {
    todo.pop(); // the `(`
    let mut args = vec![Vec::new()];
    let mut depth = 0usize;
    loop {
        let t = todo
            .pop()
            .ok_or_else(|| format!("macro `{name}`: no `)` closes its arguments"))?;
        match t.text.as_str() {
            ")" if depth == 0 => return Ok(args),
            "," if depth == 0 => args.push(Vec::new()),
            "(" => depth += 1,
            ")" => depth -= 1,
            _ => {}
        }
        if !(depth == 0 && matches!(t.text.as_str(), ",")) {
            args.last_mut().expect("one argument at least").push(t);
        }
    }
}

/// The body of `mac` with its parameters replaced by `args` (expanded first, unless pasted)
/// and `##` / `#` applied, each token hidden from `hide`.
fn substitute(
    name: &str,
    mac: &Macro,
    mut args: Vec<Vec<Tok>>,
    hide: &Rc<Vec<String>>,
    macros: &HashMap<String, Macro>,
) -> Result<Vec<Tok>, String> {
    // `F()` passes one empty argument, which is no argument for a macro without parameters.
    if mac.params.is_empty() && args.len() == 1 && args[0].is_empty() {
        args.clear();
    }
    if mac.variadic && args.len() > mac.params.len() {
        let rest = args.split_off(mac.params.len());
        let comma = Tok {
            text: ",".into(),
            hide: hide.clone(),
        };
        args.push(rest.join(&comma));
    } else if mac.variadic && args.len() == mac.params.len() {
        args.push(Vec::new());
    }
    let expected = mac.params.len() + usize::from(mac.variadic);
    if args.len() != expected {
        return Err(format!(
            "macro `{name}` takes {} arguments, given {}",
            mac.params.len(),
            args.len()
        ));
    }
    let param = |text: &str| -> Option<usize> {
        if mac.variadic && text == "__VA_ARGS__" {
            return Some(args.len() - 1);
        }
        mac.params.iter().position(|p| p == text)
    };
    let body = &mac.body;
    let mut out: Vec<Tok> = Vec::new();
    // Whether the last piece placed was empty (an empty argument: `##` then pastes nothing).
    let mut last_empty = false;
    let mut paste = false;
    let mut j = 0;
    while j < body.len() {
        let b = &body[j];
        j += 1;
        if b.text == "##" {
            paste = true;
            continue;
        }
        let piece: Vec<Tok> = match (b.text.as_str(), body.get(j).and_then(|n| param(&n.text))) {
            ("#", Some(k)) => {
                j += 1;
                let words: Vec<&str> = args[k].iter().map(|t| t.text.as_str()).collect();
                vec![Tok {
                    text: format!(
                        "\"{}\"",
                        words.join(" ").replace('\\', "\\\\").replace('"', "\\\"")
                    ),
                    hide: hide.clone(),
                }]
            }
            _ => match param(&b.text) {
                // As C does: an argument is macro-expanded before it replaces its parameter,
                // except where `##` pastes it.
                Some(k) if paste || body.get(j).is_some_and(|n| n.text == "##") => args[k].clone(),
                Some(k) => expand(args[k].clone(), macros)?,
                None => vec![b.clone()],
            },
        };
        let mut piece = piece.into_iter().map(|t| Tok {
            text: t.text,
            hide: hide.clone(),
        });
        if std::mem::take(&mut paste) && !last_empty {
            if let (Some(left), Some(right)) = (out.last_mut(), piece.next()) {
                left.text.push_str(&right.text);
                last_empty = false;
                out.extend(piece);
                continue;
            }
        }
        let before = out.len();
        out.extend(piece);
        last_empty = out.len() == before;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(src: &str) -> Vec<String> {
        global_functions(src).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn instantiation_macros_expand_to_entry_names() {
        let src = r#"
#define TYPES(X) X(f32, float) X(f64, double)
#define MORE(X) TYPES(X) X(i32, int)
// extern "C" __global__ void in_a_comment_f32(float* x) {}
#define ENTRIES(N, T) \
    extern "C" __global__ void a_##N(T* x) { body(x); } \
    extern "C" __global__ void a_b_##N(const T* x, \
                                       T* y) {}
MORE(ENTRIES)
#define PAIR(SN, S) ONE(SN, S, f32, float) ONE(SN, S, i32, int)
#define ONE(SN, S, DN, D) extern "C" __global__ void cast_##SN##_##DN(const S* s, D* d) {}
TYPES(PAIR)
#define ID(X) X
ID(ENTRIES)(f16, half)
extern "C" __global__ void plain(int n) {}
"#;
        assert_eq!(
            names(src),
            [
                "a_f32",
                "a_b_f32",
                "a_f64",
                "a_b_f64",
                "a_i32",
                "a_b_i32",
                "cast_f32_f32",
                "cast_f32_i32",
                "cast_f64_f32",
                "cast_f64_i32",
                "a_f16",
                "a_b_f16",
                "plain"
            ]
        );
    }

    #[test]
    fn arguments_expand_before_substitution_unless_pasted() {
        let src = r#"
#define ID(X) X
#define E(N) extern "C" __global__ void N(int x) {}
E(ID(ID(j_f32)))
#define P(N) extern "C" __global__ void p_##N(int x) {}
#define F32 f64
P(F32)
"#;
        // `F32` is pasted unexpanded (and object-like macros are not expanded anyway).
        assert_eq!(names(src), ["j_f32", "p_F32"]);
    }

    #[test]
    fn undef_empty_and_variadic_arguments() {
        let src = r#"
#define K(N) extern "C" __global__ void k##N(int x) {}
K(_a)
#undef K
K(_b)
#define J(P, ...) extern "C" __global__ void P##j(__VA_ARGS__) {}
J(, int a, int b)
J(x, int a)
"#;
        assert_eq!(names(src), ["k_a", "j", "xj"]);
    }

    #[test]
    fn malformed_sources_are_errors_not_omissions() {
        let err = |src: &str| global_functions(src).unwrap_err();
        assert!(err("__global__ void k(int x) {}").contains("extern"));
        assert!(err("extern \"C\" { __global__ void k(int x) {} }").contains("extern"));
        assert!(err("#ifdef X\n#endif").contains("#ifdef"));
        assert!(err("#define E(N, T) N\nE(a)").contains("takes 2 arguments, given 1"));
        assert!(err("#define E(N) N\nE(a").contains("no `)`"));
        assert!(err("/* open").contains("not closed"));
    }

    #[test]
    fn a_macro_is_not_expanded_inside_itself() {
        // C leaves `S(1)` unexpanded inside S's own expansion: no endless loop.
        assert_eq!(
            expand_source("#define S(X) S(X) + 1\nS(2)")
                .unwrap()
                .iter()
                .map(|t| t.text.as_str())
                .collect::<String>(),
            "S(2)+1"
        );
    }
}
