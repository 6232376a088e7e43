{{/*
The reference of one of Twig's images: the component's own `image` value
when set, else <image.registry>/<name>:<image.tag or the chart's
appVersion> — what scripts/build-images.sh builds and pushes.
Call with (dict "root" $ "name" "twig-controller" "image" .Values.controller.image).
*/}}
{{- define "twig.image" -}}
{{- if .image -}}
{{- .image -}}
{{- else -}}
{{- printf "%s/%s:%s" (trimSuffix "/" .root.Values.image.registry) .name (.root.Values.image.tag | default .root.Chart.AppVersion) -}}
{{- end -}}
{{- end -}}
