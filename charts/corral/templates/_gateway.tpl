{{/* The gateway's discovery rule: read-only, on the one resource its discovery source watches. */}}
{{- define "corral.gateway.rules" -}}
{{- if eq .Values.gateway.discovery.source "pods" }}
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
{{- else }}
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  verbs: ["get", "list", "watch"]
{{- end }}
# Served names and aliases come from the LLMDeployments; patch sets the wake annotation at zero.
- apiGroups: ["corral.dev"]
  resources: ["llmdeployments"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}

{{/* The gateway's settings file (`corral gateway --config`); gateway.config adds to it. */}}
{{- define "corral.gateway.config" -}}
{{- $gw := .Values.gateway }}
{{- $k8s := dict "enabled" true "source" $gw.discovery.source "label_selector" $gw.discovery.labelSelector }}
{{- with $gw.discovery.namespace }}{{ $_ := set $k8s "namespace" . }}{{ end }}
{{- $cfg := dict "host" "0.0.0.0" "port" ($gw.containerPort | int) "policy" $gw.policy "kubernetes" $k8s }}
{{- if $gw.apiKeys.existingSecret }}
{{- $_ := set $cfg "api_keys_file" (printf "/etc/corral/api-keys/%s" $gw.apiKeys.secretKey) }}
{{- end }}
{{- toYaml (mergeOverwrite $cfg (deepCopy $gw.config)) }}
{{- end }}
